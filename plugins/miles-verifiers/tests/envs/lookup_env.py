"""The verifiers env of the tests, written with verifiers' own API (it runs in the verifiers venv).

A taskset whose tasks ask for the word filed under a key; a shared MCP toolset offers ``words_lookup(key)``,
and the harness is verifiers' ``null`` chat loop, so an episode takes two model turns: the tool call, then the
answer. The rubric: ``correct`` (the last reply is the word, weight 1) and ``brief`` (``1 / (1 + length of the
reply)``, weight 0.1, so that even a random policy's replies get different rewards). ``log`` (a file) records
every reward a task gives; the tasks at the positions in ``broken`` fail their setup.

Used as a taskset id (``lookup_env``) or through :func:`load_environment`; ``python -m lookup_env`` serves the
toolset (that is how verifiers starts a tool server).
"""

from __future__ import annotations

import json
from pathlib import Path

import verifiers.v1 as vf

WORDS = {"k0": "apple", "k1": "pear", "k2": "plum", "k3": "fig", "k4": "lime", "k5": "kiwi", "k6": "date",
         "k7": "sloe"}


class WordsToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "words"

    @vf.tool
    async def lookup(self, key: str) -> str:
        """The word filed under a key."""
        return WORDS.get(key, f"no word is filed under {key!r}")


class LookupData(vf.TaskData):
    answer: str  # the task's id is the key it asks about
    broken: bool = False


class LookupTaskConfig(vf.TaskConfig):
    log: str | None = None


class LookupTask(vf.Task[LookupData, vf.State, LookupTaskConfig]):
    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        if self.data.broken:
            raise RuntimeError(f"task {self.data.id} is broken on purpose")

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return self._logged(trace, "correct", float(trace.last_reply == self.data.answer), 1.0)

    @vf.reward(weight=0.1)
    async def brief(self, trace: vf.Trace) -> float:
        return self._logged(trace, "brief", 1.0 / (1 + len(trace.last_reply)), 0.1)

    @vf.metric
    async def lookups(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))

    def _logged(self, trace: vf.Trace, name: str, value: float, weight: float) -> float:
        if self.config.log:
            with open(self.config.log, "a") as f:
                f.write(json.dumps({"trace": trace.id, "task": self.data.idx, "reply": trace.last_reply,
                                    "reward": name, "value": value * weight}) + "\n")
        return value


class LookupConfig(vf.TasksetConfig):
    task: LookupTaskConfig = LookupTaskConfig()
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    broken: list[int] = []


class LookupTaskset(vf.Taskset[LookupTask, LookupConfig]):
    def load(self) -> list[LookupTask]:
        return [LookupTask(LookupData(prompt=f"Which word is filed under {key}? Answer with the word alone.",
                                      id=key, answer=word, broken=i in self.config.broken), self.config.task)
                for i, (key, word) in enumerate(WORDS.items())]

    @classmethod
    def toolsets(cls, config: LookupConfig) -> list[vf.Toolset]:
        return [WordsToolset(config.tools)]


def load_environment(log: str | None = None, broken: tuple[int, ...] = (), max_turns: int = 4) -> vf.Env:
    """The env in Python: the taskset with verifiers' ``null`` harness on the local ``subprocess`` runtime."""
    return vf.load_environment(vf.resolve_env_config({
        "taskset": {"id": Path(__file__).stem, "broken": list(broken), "task": {"log": log}},
        "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}, "max_turns": max_turns},
    }))


__all__ = ["LookupTaskset"]

if __name__ == "__main__":
    WordsToolset.run()
