"""``EnvConformance``: the contract every environment keeps, checked with a ``ScriptedPolicy`` in place of the
engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.testing.fixtures import fixture, make_registry, pytest
from miles.types import Sample


class ScriptedPolicy:
    """An engine stand-in for checking environments: it answers every turn with the text a scripted policy
    gives, as the tokens a real engine would return (the turn's end-of-turn token included, log-prob 0.0).

    ``act(turn, observation)`` gets the number of the turn (1, 2, ...) and the text of the last message the
    model saw (the prompt's last message on turn 1), decoded from the prompt tokens it is sent.
    """

    def __init__(self, tokenizer: Any, act: Any, eot: str = "<|im_end|>") -> None:
        self.tokenizer, self.act = tokenizer, act
        self.eot_id = tokenizer.convert_tokens_to_ids(eot)
        self.calls = 0

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any],
                       return_logprob: bool = True) -> dict:
        self.calls += 1
        text = self.tokenizer.decode(input_ids, skip_special_tokens=False)
        turns = text.split("<|im_start|>")
        turn = sum(part.startswith("assistant") for part in turns)  # the generation prompt is the last one
        last = turns[-2] if len(turns) >= 2 else ""
        observation = last.split("\n", 1)[1] if "\n" in last else ""
        observation = observation.removesuffix("\n").removesuffix("<|im_end|>")
        ids = self.tokenizer.encode(self.act(turn, observation), add_special_tokens=False) + [self.eot_id]
        limit = int(sampling_params.get("max_new_tokens", len(ids)))
        finish = {"type": "stop", "matched": self.eot_id} if len(ids) <= limit else {"type": "length", "length": limit}
        ids = ids[:limit]
        return {"output_ids": ids, "text": self.tokenizer.decode(ids),
                "meta_info": {"output_token_logprobs": [[0.0, i, None] for i in ids], "finish_reason": finish,
                              "weight_version": 0, "prompt_tokens": len(input_ids), "completion_tokens": len(ids)}}


class _WatchedEnv:
    """An env as the conformance checks see it: counts closes and steps, and fails a step on request."""

    def __init__(self, env: Any, fail_at_step: int | None = None) -> None:
        self.env, self.fail_at_step = env, fail_at_step
        self.steps = self.closes = 0

    @property
    def tools(self) -> Any:
        return getattr(self.env, "tools", None)

    async def reset(self, sample: Any) -> Any:
        return await self.env.reset(sample)

    async def step(self, action: Any) -> Any:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError(f"injected failure at step {self.steps}")
        return await self.env.step(action)

    async def close(self) -> None:
        self.closes += 1
        await self.env.close()


class EnvConformance:
    """The contract every environment keeps. Subclass it in a test module of your env plugin:

        class TestMyEnv(EnvConformance):
            min_steps = 2

            def make_env(self, ctx):
                return MyEnv(ctx, url=...)

            def act(self, turn, observation):
                return '<tool_call>{"name": "guess", "arguments": {"n": 5}}</tool_call>'

    Episodes run through Miles' real ``multi_turn`` rollout function with a :class:`ScriptedPolicy` in place
    of the engine (the policy is the test's input here; the env is what is checked) and the tiny chat
    tokenizer of the ``chat_model_dir`` fixture (``from miles.testing import chat_model_dir`` in your
    ``conftest.py``; ``pytest_plugins`` works only in a repository's top conftest).
    """

    min_steps: int = 2  # the scripted policy's episodes take at least this many env steps
    max_turns: int = 8
    tool_parser: str = "hermes"
    episodes: int = 16  # episodes at once in the concurrency checks
    timeout_s: float = 300.0  # a safety net per check, not a measurement

    def make_env(self, ctx: Any) -> Any:
        """A fresh env, as your registered factory makes it for ``ctx`` (a :class:`miles.EnvContext`)."""
        raise NotImplementedError

    def act(self, turn: int, observation: str) -> str:
        """The scripted policy: the text of assistant turn ``turn`` given the last message's text."""
        raise NotImplementedError

    def make_sample(self, index: int) -> Sample:
        """The sample episode ``index`` starts from."""
        return Sample(prompt=f"episode {index}", prompt_ids=[0], index=index, metadata={"data": {}})

    def expected_reward(self, index: int) -> float | None:
        """The reward episode ``index`` must end with; None accepts any number (or dict of numbers)."""
        return None

    def sandbox_factory(self) -> Any:
        """The sandbox factory for envs that use ``ctx.sandbox`` (None: no sandbox)."""
        return None

    def leftovers(self) -> list[str]:
        """What the env's backing service still holds (sessions, containers ...); [] once every env closed."""
        return []

    # -- the harness ----------------------------------------------------------------------------------

    @fixture(autouse=True)
    def _env_harness(self, chat_model_dir: Path) -> None:
        self.set_up_harness(chat_model_dir)

    def set_up_harness(self, model_dir: Path) -> None:
        """The tokenizer and the registry the checks use (the fixture calls it; so can a test of the harness)."""
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._registry = make_registry(autoload=True)

    def _context(self, fail: dict[int, int] | None = None) -> tuple[Any, list[_WatchedEnv]]:
        from miles.config.validate import resolve_tool
        from miles.rollout.context import RolloutContext

        made: list[_WatchedEnv] = []

        def factory(env_ctx: Any) -> _WatchedEnv:
            watched = _WatchedEnv(self.make_env(env_ctx), (fail or {}).get(len(made)))
            made.append(watched)
            return watched

        ctx = RolloutContext(
            engine=ScriptedPolicy(self._tokenizer, self.act), tokenizer=self._tokenizer,
            sampling_params={"max_new_tokens": 4096}, env=factory, sandbox=self.sandbox_factory(),
            tool_parser=self._registry.build("tool_parser", {"name": self.tool_parser}, "rollout.tool_parser"),
            tool=lambda name: resolve_tool(self._registry, name, "rollout.env.tools"),
            # ``act`` writes turns in any layout, not only the template's: a turn the template renders otherwise is
            # re-rendered in place (out of the loss), so that every observation stays in the one trajectory
            tito_on_mismatch="retokenize")
        return ctx, made

    def run_episodes(self, count: int, fail: dict[int, int] | None = None) -> tuple[list[Sample], list[_WatchedEnv]]:
        """Run ``count`` episodes at once (episode ``i``'s env fails at step ``fail[i]``); wait until no
        other task of the loop is left, and return the samples and the envs."""
        import asyncio

        from miles.rollout.generate import run_one
        from miles.rollout.multi_turn import MultiTurn

        ctx, made = self._context(fail)
        samples = [self.make_sample(i) for i in range(count)]
        rollout = MultiTurn(max_turns=self.max_turns)

        async def main() -> list[asyncio.Task]:
            await asyncio.wait_for(asyncio.gather(*(run_one(rollout, s, ctx) for s in samples)), self.timeout_s)
            for _ in range(200):  # background work of closed envs (a socket's closing handshake) winds down
                others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
                if not others:
                    break
                await asyncio.sleep(0.05)
            return others

        left = asyncio.run(main())
        assert not left, f"tasks still running after every episode ended: {left}"
        return samples, made

    def _check_finished(self, sample: Sample, index: int) -> None:
        from miles.types import SampleStatus

        assert sample.status is SampleStatus.COMPLETED, f"episode {index}: {sample.status.value}: {sample.reason}"
        assert sample.turns >= self.min_steps, f"episode {index} ended after {sample.turns} turns"
        reward = sample.metadata.get("env_reward")
        assert reward is not None, f"episode {index} ended without a reward from the env"
        values = reward.values() if isinstance(reward, dict) else [reward]
        assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values), reward
        expected = self.expected_reward(index)
        if expected is not None:
            assert reward == pytest.approx(expected), f"episode {index}: reward {reward}, expected {expected}"
        if sample.turns >= 2:
            assert sample.loss_mask.count(0) > 0, "the env's observations belong in the trajectory (loss mask 0)"

    @staticmethod
    def _children() -> set[int]:
        """Live child processes of this process (zombies reaped or not, they are not running)."""
        import os

        children = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == os.getpid() and fields[0] != "Z":
                    children.add(int(entry.name))
        return children

    def test_an_episode_runs_to_done_with_a_reward(self) -> None:
        (sample,), (env,) = self.run_episodes(1)
        self._check_finished(sample, 0)
        assert env.steps >= self.min_steps and env.closes == 1

    def test_reset_step_and_close_called_directly(self) -> None:
        import asyncio

        from miles.agentic.chat import normalize_messages
        from miles.agentic.tool_calls import check_calls
        from miles.agentic.types import Action, EnvContext, StepResult

        ctx, _ = self._context()

        async def main() -> tuple[Any, Any, StepResult]:
            env_ctx = EnvContext(ctx.sandbox, ctx.tool, 0)
            env = self.make_env(env_ctx)
            try:
                first = normalize_messages(await env.reset(self.make_sample(0)), role="user")
                tools = list(getattr(env, "tools", None) or [])
                text = self.act(1, str(first[-1].get("content", "")) if first else "episode 0")
                calls = check_calls(ctx.tool_parser.parse(text), tools)
                result = await env.step(Action(text, calls.valid))
                return first, tools, result
            finally:
                await env.close()
                await env_ctx.close()

        first, tools, result = asyncio.run(main())
        assert isinstance(first, list) and all(isinstance(m, dict) and "role" in m for m in first)
        assert all(t.get("type") == "function" and "name" in t["function"] for t in tools), tools
        assert isinstance(result, StepResult), f"step returned {type(result).__name__}, expected StepResult"
        assert isinstance(result.info, dict)

    def test_concurrent_episodes(self) -> None:
        samples, envs = self.run_episodes(self.episodes)
        for i, sample in enumerate(samples):
            self._check_finished(sample, i)
        assert [env.closes for env in envs] == [1] * self.episodes

    def test_an_env_that_raises_fails_only_its_sample(self) -> None:
        from miles.types import SampleStatus

        broken = self.episodes // 2
        samples, envs = self.run_episodes(self.episodes, fail={broken: 2 if self.min_steps >= 2 else 1})
        assert samples[broken].status is SampleStatus.FAILED
        assert "injected failure" in (samples[broken].reason or ""), samples[broken].reason
        for i, sample in enumerate(samples):
            if i != broken:
                self._check_finished(sample, i)
        assert [env.closes for env in envs] == [1] * self.episodes, "every env is closed, the failed one too"

    def test_nothing_is_left_running(self) -> None:
        before = self._children()
        self.run_episodes(4, fail={1: 1})
        assert self.leftovers() == [], "the env's service still holds something after every env closed"
        assert not (self._children() - before), "a process an env started outlived its episode"
