"""miles-verifiers against the real verifiers 0.4.0 (in its own venv) and Miles' session server.

The env is ``tests/envs/lookup_env.py``, written with verifiers' API: a taskset, a shared MCP toolset and a
rubric, played by verifiers' own ``null`` chat harness. The protocol checks put a scripted policy
(``miles.testing.ScriptedPolicy``, with the tiny chat model's tokenizer) behind the session server, so that the
turns are known; the training check runs the tiny model itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from miles import Sample, SampleStatus
from miles.errors import EXIT_USAGE, ConfigError
from miles.testing import ScriptedPolicy, build_chat_model, make_registry, make_sample
from miles_verifiers import close_workers, plugin, verifiers_tasks
from miles_verifiers.agent import check_rollout_args
from miles_verifiers.spec import WORKER_DIR

from verifiers_testing import ENVS, started_by

AGENT = "miles_verifiers:rollout"
WORDS = {"k0": "apple", "k1": "pear", "k2": "plum", "k3": "fig", "k4": "lime", "k5": "kiwi", "k6": "date",
         "k7": "sloe"}  # lookup_env's


def brief(reply: str) -> float:
    """lookup_env's ``brief`` reward, weighted."""
    return 0.1 / (1 + len(reply))


@pytest.fixture(scope="module")
def env_args(verifiers_python) -> dict:
    """The component arguments of every check here (one spec, so one worker serves them all)."""
    return {"env": "lookup_env:load_environment", "env_args": {"broken": [2]}, "python": verifiers_python,
            "pythonpath": [str(ENVS)]}


@pytest.fixture(scope="module")
def registry():
    """Miles' builtins and this plugin (no other installed plugin)."""
    return make_registry(plugin)


@pytest.fixture(scope="module")
def tokenizer(chat_model_dir):
    return AutoTokenizer.from_pretrained(str(chat_model_dir))


def look_it_up(turn: int, observation: str) -> str:
    """The scripted policy: call the tool with the key the prompt names, then answer with what it returned
    (except for ``fig``, answered wrong as ``figs``). The call is written as the chat template renders it (what a
    model trained on the template writes), so the session's tokens stay the template's rendering."""
    if turn == 1:
        key = re.search(r"under (k\d)", observation).group(1)
        return f'<tool_call>\n{{"name": "words_lookup", "arguments": {{"key": "{key}"}}}}\n</tool_call>'
    word = re.search(r"<tool_response>\n(.*)\n</tool_response>", observation).group(1)
    return "figs" if word == "fig" else word


def run_agent(registry, tokenizer, args: dict, tasks: list, context_length: int | None = None) -> list[Sample]:
    """Samples of ``tasks`` (their data rows' ``task``), run at once by Miles' ``agent`` rollout function."""
    from miles.rollout.context import RolloutContext  # what the run gives a rollout function (no public maker yet)

    agent = registry.build("rollout_fn", {"name": "agent", "agent": AGENT, **args}, "rollout.fn")
    context = RolloutContext(engine=ScriptedPolicy(tokenizer, look_it_up), tokenizer=tokenizer,
                             sampling_params={"max_new_tokens": 128}, context_length=context_length,
                             tool_parser=registry.build("tool_parser", {"name": "hermes"}, "rollout.tool_parser"))
    samples = [Sample(prompt="(the task's own)", prompt_ids=[0], index=i, metadata={"data": {"task": task}})
               for i, task in enumerate(tasks)]

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(agent(s, context) for s in samples)), timeout=600)

    asyncio.run(main())
    return samples


def test_episodes_go_through_the_session_and_the_rubric_rewards_them(registry, tokenizer, env_args):
    first, by_id, broken, wrong, absent, no_column = run_agent(registry, tokenizer, env_args,
                                                               [0, "k1", 2, 3, 99, None])
    for sample, word in ((first, "apple"), (by_id, "pear")):
        assert sample.status is SampleStatus.COMPLETED, sample.reason
        assert sample.metadata["env_reward"] == pytest.approx(1.0 + brief(word))
        details = sample.metadata["verifiers"]
        assert details["rewards"] == pytest.approx({"correct": 1.0, "brief": brief(word)})
        assert details["metrics"] == {"lookups": 1.0} and details["turns"] == 2
        assert details["stop"] == "agent_completed"
    assert wrong.status is SampleStatus.COMPLETED
    assert wrong.metadata["env_reward"] == pytest.approx(brief("figs"))  # the rubric, not a constant

    # The session recorded the episode token for token: both policy turns (loss mask 1), the tool's answer
    # between them (mask 0), in the rendering of verifiers' messages by the model's chat template.
    text = tokenizer.decode(first.response_ids)
    call = '<tool_call>\n{"name": "words_lookup", "arguments": {"key": "k0"}}\n</tool_call><|im_end|>'
    assert text == f"{call}\n<|im_start|>user\n<tool_response>\napple\n</tool_response><|im_end|>\n" \
                   f"<|im_start|>assistant\napple<|im_end|>"
    generated = [t for t, m in zip(first.response_ids, first.loss_mask) if m]
    assert tokenizer.decode(generated) == f"{call}apple<|im_end|>"
    assert len(first.rollout_logprobs) == len(first.response_ids) == len(first.loss_mask)
    prompt = tokenizer.decode(first.prompt_ids)
    assert '"name": "words_lookup"' in prompt  # the toolset's schema, as the harness offered it
    assert prompt.endswith("Which word is filed under k0? Answer with the word alone.<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert first.turns == 2 and first.metadata["tools"]["calls"] == 1

    # A failing episode fails its own sample, with verifiers' reason; the others went on.
    assert broken.status is SampleStatus.FAILED
    assert broken.reason.startswith(f"rollout: agent {AGENT} raised WorkerError: RuntimeError: the rollout failed: "
                                    f"TaskError: task setup")
    assert "task k2 is broken on purpose" in broken.reason
    assert absent.status is SampleStatus.FAILED
    assert "IndexError: task 99: the taskset has 8 tasks (positions 0-7)" in absent.reason
    assert no_column.status is SampleStatus.FAILED
    assert "column 'task': expected a task position (int) or id (str), got None" in no_column.reason


def test_a_trajectory_that_reaches_the_context_length_is_a_truncated_sample(registry, tokenizer, env_args):
    """The session ends where the model's context does. Cut inside the tool call, the turn has no call (its text is
    the reply), so the harness stops and the rubric scores the cut reply; cut right after a whole call, the harness
    runs the tool and its next model call is refused: the sample is truncated, without a reward (the ``env``
    reward's ``truncated``)."""
    [reference] = run_agent(registry, tokenizer, env_args, [0])
    call = look_it_up(1, "under k0")
    whole_call = len(reference.prompt_ids) + len(tokenizer.encode(call, add_special_tokens=False)) + 1
    [inside] = run_agent(registry, tokenizer, env_args, [0], context_length=whole_call - 5)
    assert inside.status is SampleStatus.TRUNCATED and inside.metadata["tools"]["parse_errors"] == 1
    cut_reply = tokenizer.decode([t for t, m in zip(inside.response_ids, inside.loss_mask) if m])
    assert cut_reply.startswith("<tool_call>\n") and len(cut_reply) > 20
    # the turn is its text (as a server hands back a call it cannot read), and the rubric scores that
    assert inside.metadata["env_reward"] == pytest.approx(brief(cut_reply))
    [after] = run_agent(registry, tokenizer, env_args, [0], context_length=whole_call)
    assert after.status is SampleStatus.TRUNCATED, after.reason
    assert after.reason == f"the context length ({whole_call} tokens) reached"
    assert tokenizer.decode(after.response_ids).endswith("</tool_call>") and "env_reward" not in after.metadata
    assert "session_ended" in after.metadata["verifiers"]["error"]


class StalledPolicy(ScriptedPolicy):
    """A scripted policy whose generations wait for ``release``; ``called`` is set once one was asked for."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, lambda turn, observation: "too late")
        self.called, self.release = asyncio.Event(), asyncio.Event()

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        self.called.set()
        await self.release.wait()
        return await super().generate(input_ids, sampling_params, return_logprob)


def harness_programs() -> list[str]:
    """verifiers' chat harness processes started for this process (they get the model URL as --base-url)."""
    return [p for p in started_by(os.getpid()) if "--base-url=" in p]


def test_a_cancelled_rollout_stops_its_episode_and_the_worker_goes_on(registry, tokenizer, env_args):
    """Miles cancels a rollout that runs past rollout.fn.timeout_s, or when the run stops: the worker cancels the
    episode, whose harness program ends while its model call is still unanswered."""
    from miles.rollout.context import RolloutContext

    agent = registry.build("rollout_fn", {"name": "agent", "agent": AGENT, **env_args}, "rollout.fn")
    policy = StalledPolicy(tokenizer)
    context = RolloutContext(engine=policy, tokenizer=tokenizer, sampling_params={"max_new_tokens": 8})

    async def main() -> list[str]:
        rollout = asyncio.create_task(agent(Sample(prompt="", prompt_ids=[0], metadata={"data": {"task": 5}}), context))
        await asyncio.wait_for(policy.called.wait(), timeout=300)  # a safety net: the episode is under way
        assert harness_programs() != []
        rollout.cancel()
        for _ in range(600):  # polled; a minute is a safety net, not a measurement
            if not harness_programs():
                break
            await asyncio.sleep(0.1)
        left = harness_programs()
        policy.release.set()  # only now can the stalled generation end (and the session server stop)
        with pytest.raises(asyncio.CancelledError):
            await rollout
        return left

    assert asyncio.run(main()) == []
    [after] = run_agent(registry, tokenizer, env_args, [5])
    assert after.status is SampleStatus.COMPLETED and after.metadata["env_reward"] == pytest.approx(1 + brief("kiwi"))


def test_the_reward_scores_a_single_turn_reply(registry, env_args):
    reward = registry.build("reward", {"name": "verifiers", **env_args}, "reward")

    def score(task, reply: str) -> float:
        return asyncio.run(reward(make_sample(reply, prompt="Which word is filed under k1?",
                                              metadata={"data": {"task": task}})))

    assert score(1, "pear") == pytest.approx(1.0 + brief("pear"))
    assert score("k1", "a pear") == pytest.approx(brief("a pear"))
    with pytest.raises(ValueError, match="the sample's data row has no 'task' column"):
        asyncio.run(reward(make_sample("pear", prompt="?", metadata={"data": {}})))


def test_the_generator_makes_a_row_per_task(env_args):
    """Here the env is named by its taskset id, with verifiers' [env] config as env_args."""
    env_args = {**env_args, "env": "lookup_env",
                "env_args": {"agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}}
    data = verifiers_tasks(0, **env_args, eval_tasks=2)
    assert [row["task"] for row in data["train"]] == list(range(6))
    assert data["eval"] == [{"prompt": "Which word is filed under k6? Answer with the word alone.", "label": "k6",
                             "task": 6},
                            {"prompt": "Which word is filed under k7? Answer with the word alone.", "label": "k7",
                             "task": 7}]
    assert len(verifiers_tasks(0, **env_args, limit=3)["train"]) == 3
    with pytest.raises(ValueError, match="eval_tasks: 8 of 8 tasks leaves none to train on"):
        verifiers_tasks(0, **env_args, eval_tasks=8)


def test_bad_arguments_name_what_is_wrong(env_args, tmp_path):
    def problem(**changes) -> str:
        with pytest.raises(ValueError) as caught:
            check_rollout_args({**env_args, **changes})
        return str(caught.value)

    assert problem(env=3).startswith("env: expected a verifiers taskset id or an import path")
    assert problem(env_args=[1]) == "env_args: expected a mapping (the env's arguments), got list"
    assert problem(python=str(tmp_path / "python")) == \
        f"python: the verifiers venv's interpreter {tmp_path / 'python'} does not exist"
    assert problem(pythonpath=[str(tmp_path / "nope")]) == f"pythonpath: {tmp_path / 'nope'} is not a folder"
    assert problem(task_column="") == "task_column: expected the name of a data column, got ''"
    assert problem(env_args={"colour": "red"}) == ("env 'lookup_env:load_environment' does not load: TypeError: "
                                                   "load_environment() got an unexpected keyword argument 'colour'")


def train_config(tmp_path: Path, env_args: dict, model_dir: Path, data: dict | None = None, **fn) -> Path:
    config = {
        "model": {"path": str(model_dir)},
        "data": data or {"generator": {"name": "verifiers_tasks", **env_args, "eval_tasks": 2}},
        "rollout": {"fn": {"name": "agent", "agent": AGENT, **env_args, **fn}, "prompts_per_step": 1,
                    "n_samples": 2, "sampling": {"max_new_tokens": 12, "temperature": 1.0}},
        "reward": {"name": "env"},
        "advantage": {"name": "grpo"},
        "loss": {"name": "ppo_clip"},
        "backend": {"name": "torch", "lr": 1.0e-3, "micro_batch_size": 4},
        "run": {"steps": 2, "dir": str(tmp_path / "run"), "eval_size": 0, "progress": False, "torch_threads": 1,
                "plugins": {"allow": ["verifiers"]}},
    }
    path = tmp_path / "verifiers.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def miles_train(config: Path) -> tuple[int, str, int]:
    """``python -m miles train config``: its exit code, its stderr, and its process id."""
    process = subprocess.Popen([sys.executable, "-m", "miles", "train", str(config)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    _, stderr = process.communicate(timeout=900)
    return process.returncode, stderr, process.pid


def test_an_env_that_does_not_load_stops_the_run_at_start(tmp_path, env_args, chat_model_dir):
    """Config validation, as ``miles train`` runs it first: a ConfigError, which the command exits 2 with."""
    from miles.run.runner import prepare

    rows = tmp_path / "train.jsonl"
    rows.write_text(json.dumps({"prompt": "Which word is filed under k0?", "label": "", "task": 0}) + "\n")
    config = train_config(tmp_path, env_args, chat_model_dir, data={"train_path": str(rows)},
                          env="no_such_module:make_env")
    with pytest.raises(ConfigError) as caught:
        prepare(config)
    assert caught.value.exit_code == EXIT_USAGE
    assert "rollout.fn: rollout_fn 'agent' rejected its arguments: env 'no_such_module:make_env' does not load: " \
           "ModuleNotFoundError: No module named 'no_such_module'" in str(caught.value)


@pytest.mark.slow
def test_grpo_trains_through_a_verifiers_env(tmp_path, env_args, tmp_path_factory):
    """Two GRPO steps of the tiny model (random, so it rarely calls the tool): every rollout is a verifiers
    episode, and the rewards its rubric gave are the rewards Miles trained on."""
    model_dir = build_chat_model(tmp_path_factory.mktemp("model") / "model", max_position_embeddings=1024)
    log = tmp_path / "rewards.jsonl"
    args = {**env_args, "env_args": {"log": str(log)}}
    code, stderr, pid = miles_train(train_config(tmp_path, args, model_dir))
    assert code == 0, stderr[-3000:]
    assert started_by(pid) == []  # the run's worker and what it started are gone
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in steps] == [0, 1]
    assert all(s["samples/failed"] == 0 and s["samples/total"] == 2 for s in steps)
    given: dict[str, float] = {}
    for line in log.read_text().splitlines():  # what the rubric gave, reward by reward, per trace
        entry = json.loads(line)
        given[entry["trace"]] = given.get(entry["trace"], 0.0) + entry["value"]
    assert len(given) == 4
    assert sum(s["reward/mean"] * 2 for s in steps) == pytest.approx(sum(given.values()))
    assert all(0.0 < v <= 1.1 for v in given.values())  # brief() is positive whatever the reply


@pytest.mark.slow
def test_grpo_trains_through_a_verifiers_env_with_the_async_schedule(tmp_path, env_args, tmp_path_factory):
    """The same episodes as agents through Miles sessions, generated by the stream while the trainer trains
    (run.schedule: async, updates in place): each step trains one full group on samples at most one version old."""
    model_dir = build_chat_model(tmp_path_factory.mktemp("model") / "model", max_position_embeddings=1024)
    config = train_config(tmp_path, {**env_args, "env_args": {}}, model_dir)  # no task broken on purpose
    data = yaml.safe_load(config.read_text())
    data["run"].update(schedule="async", steps=3)
    data["rollout"]["async"] = {"max_staleness": 1, "update": "in_place"}
    config.write_text(yaml.safe_dump(data))
    code, stderr, pid = miles_train(config)
    assert code == 0, stderr[-3000:]
    assert started_by(pid) == []
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(s["samples/failed"] == 0 and s["train/samples"] == 2 and s["async/staleness_max"] <= 1 for s in steps)


def test_closing_the_workers_leaves_nothing_running(registry, tokenizer, env_args):
    run_agent(registry, tokenizer, env_args, [4])  # a worker, its tool server, a harness program ran
    close_workers()
    assert started_by(os.getpid()) == []


def test_the_uv_stand_in_refuses_a_script_whose_dependencies_are_missing(verifiers_python, tmp_path):
    script = tmp_path / "program.py"
    script.write_text('# /// script\n# dependencies = ["openai", "no-such-distribution>=1"]\n# ///\nprint(1)\n')
    stand_in = str(WORKER_DIR / "miles_verifiers_worker" / "uv.py")
    found = subprocess.run([verifiers_python, stand_in, "python", "find", "--script", str(script)],
                           capture_output=True, text=True)
    assert found.stdout.strip() == verifiers_python
    sync = subprocess.run([verifiers_python, stand_in, "sync", "--script", str(script), "-q", "--no-config"],
                          capture_output=True, text=True)
    assert sync.returncode == 1
    assert f"the harness program {script} needs no-such-distribution>=1, which the verifiers venv" in sync.stderr
    other = subprocess.run([verifiers_python, stand_in, "pip", "install", "x"], capture_output=True, text=True)
    assert other.returncode == 2 and "`uv pip install x` is not supported by the uv stand-in" in other.stderr
