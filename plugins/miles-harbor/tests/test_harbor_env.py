"""The ``harbor`` env on the real local sandbox (bubblewrap): the env conformance suite, the shipped tasks'
rewards, what a command sees, bad input, config checks and the data generator."""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from harbor_testing import FULL, NAMES, TASKS, TOML, bash_call, solution, write_task
from miles import Action, EnvContext, Sample, StepResult, ToolCall
from miles.agentic.sandboxes.local import LocalSandbox
from miles.testing import MILES_WITH_CTRL_C, EnvConformance
from miles_harbor.data import harbor_tasks
from miles_harbor.env import HarborEnv
from miles_harbor.provision import SetupError
from miles_harbor.task import TaskError
from miles_harbor.verifier import VerifierError

INSTRUCTIONS = {name: (TASKS / name / "instruction.md").read_text().strip() for name in NAMES}
ROOT = Path(__file__).resolve().parents[3]  # the Miles checkout: the example config's paths start there
CONFIG = ROOT / "plugins" / "miles-harbor" / "configs" / "harbor.yaml"


def bwrap_sandbox() -> Any:
    return functools.partial(LocalSandbox, isolation="bwrap")


def task_sample(name: str, index: int = 0, *, label: Any = None) -> Sample:
    return Sample(prompt=f"episode {index}", prompt_ids=[0], index=index, label=label,
                  metadata={"data": {"task": name} if name else {}})


class TestHarborEnvConformance(EnvConformance):
    """Episodes of the three shipped tasks (in turn) through Miles' multi_turn: turn 1 runs the task's
    solve.sh through the bash tool, turn 2 answers without a call, so the verifier grades it."""

    min_steps = 2

    def make_env(self, ctx: EnvContext) -> HarborEnv:
        return HarborEnv(ctx, str(TASKS))

    def make_sample(self, index: int) -> Sample:
        return task_sample(NAMES[index % len(NAMES)], index)

    def act(self, turn: int, observation: str) -> str:
        if turn > 1:
            return "Done."
        name = next(name for name, text in INSTRUCTIONS.items() if text in observation)
        return bash_call(solution(name))

    def expected_reward(self, index: int) -> Any:
        return FULL[NAMES[index % len(NAMES)]]

    def sandbox_factory(self) -> Any:
        return bwrap_sandbox()


def play(name: str, commands: list[str], *, tasks: Path = TASKS, sample: Sample | None = None,
         **env_args: Any) -> tuple[list[dict], list[StepResult]]:
    """One episode driven directly: reset, a bash call per command, then a turn without a call (unless
    an earlier step ended it). The first messages and the step results; env and sandbox always closed."""

    async def main() -> tuple[list[dict], list[StepResult]]:
        ctx = EnvContext(bwrap_sandbox())
        env = HarborEnv(ctx, str(tasks), **env_args)
        results: list[StepResult] = []
        try:
            first = await env.reset(sample or task_sample(name))
            for i, command in enumerate(commands):
                results.append(await env.step(Action("", [ToolCall("bash", {"command": command}, f"call_{i}")])))
                if results[-1].done:
                    return first, results
            results.append(await env.step(Action("Done.")))
            return first, results
        finally:
            await env.close()
            await ctx.close()

    return asyncio.run(main())


def reward_of(name: str, commands: list[str], **kwargs: Any) -> Any:
    _, results = play(name, commands, **kwargs)
    assert results[-1].done
    return results[-1].reward


# -- the shipped tasks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_the_solution_earns_the_full_reward_and_doing_nothing_none(name: str) -> None:
    assert reward_of(name, [solution(name)]) == FULL[name]
    nothing = reward_of(name, [])
    zero = {"reward": 0.0, "rows": 0.0, "total": 0.0, "score": 0.0} if name == "partial-credit" else 0.0
    assert nothing == zero


def test_partial_credit_from_reward_json() -> None:
    rows_only = "printf '{\"rows\": 4, \"total\": 1}' > /app/summary.json"
    assert reward_of("partial-credit", [rows_only]) == {"reward": 0.5, "rows": 1.0, "total": 0.0, "score": 0.5}


def test_reset_gives_the_instruction_and_the_bash_tool() -> None:
    first, _ = play("fix-bug", [])
    assert first == [{"role": "user", "content": INSTRUCTIONS["fix-bug"]}]
    env = HarborEnv(EnvContext(), str(TASKS))
    assert [tool["function"]["name"] for tool in env.tools] == ["bash"]
    assert env.tools[0]["function"]["parameters"]["required"] == ["command"]


def test_the_task_comes_from_the_row_then_the_label() -> None:
    first, _ = play("", [], sample=task_sample("", label="create-file"))
    assert first[0]["content"] == INSTRUCTIONS["create-file"]
    first, _ = play("", [], sample=task_sample("fix-bug", label="create-file"))
    assert first[0]["content"] == INSTRUCTIONS["fix-bug"]


# -- what commands see ----------------------------------------------------------------------------------------


def test_commands_see_the_dockerfile_build(tmp_path: Path) -> None:
    dockerfile = ("FROM python:3.12-slim\nARG STAGE=build\nENV GREETING=\"hi there\" PATH=/app/bin:$PATH\n"
                  "WORKDIR /app\nCOPY bin/ /app/bin/\nCOPY notes.txt .\nRUN echo \"$STAGE $GREETING\" > made.txt\n"
                  "WORKDIR src\nUSER nobody\nCMD [\"python3\"]\n")
    toml = TOML + '\n[environment]\nenv = {COLOR = "blue", FROM_HOST = "${MILES_HARBOR_UNSET:-fallback}"}\n'
    write_task(tmp_path, "built", dockerfile=dockerfile, toml=toml,
               files={"environment/bin/hello": "#!/bin/sh\necho hello from bin\n", "environment/notes.txt": "n\n"})
    (tmp_path / "built" / "environment" / "bin" / "hello").chmod(0o755)
    _, results = play("built", ["pwd; cat /app/made.txt /app/notes.txt; echo $COLOR $FROM_HOST; hello",
                                "echo ${STAGE:-no-arg-at-runtime}"], tasks=tmp_path)
    assert results[0].observation[0]["content"] == "/app/src\nbuild hi there\nn\nblue fallback\nhello from bin\n"
    assert results[1].observation[0]["content"] == "no-arg-at-runtime\n"
    assert results[-1].reward == 1.0


def test_a_command_reports_its_exit_code_and_timeout(tmp_path: Path) -> None:
    write_task(tmp_path, "plain")
    _, results = play("plain", ["echo out; echo err >&2; exit 3", "sleep 30"], tasks=tmp_path, command_timeout_s=1)
    failed, slow = (r.info["tool_results"][0] for r in results[:2])
    assert failed.content == "out\nerr\n\n[exit code 3]" and not failed.ok
    assert slow.timed_out and slow.content.endswith("[timed out after 1 s]")


def test_long_output_is_cut(tmp_path: Path) -> None:
    write_task(tmp_path, "plain")
    _, results = play("plain", ["head -c 500 /dev/zero | tr '\\0' x"], tasks=tmp_path, max_observation_chars=100)
    assert results[0].observation[0]["content"] == "x" * 100 + "\n[... 400 more characters cut]"


def test_the_tests_are_hidden_and_planted_rewards_removed(tmp_path: Path) -> None:
    write_task(tmp_path, "silent", test="#!/bin/bash\necho checking\n")
    cheat = "ls -A /tests; echo 1 > /logs/verifier/reward.txt; echo '{\"reward\": 1}' > /logs/verifier/reward.json"
    with pytest.raises(VerifierError, match="wrote no reward") as failure:
        play("silent", [cheat], tasks=tmp_path)
    assert "its output ends: checking" in str(failure.value)
    _, results = play("fix-bug", ["ls -A /tests"])
    assert results[0].observation[0]["content"] == ""


def test_max_turns_grades_the_last_turn() -> None:
    _, results = play("create-file", [solution("create-file"), "echo never"], max_turns=1)
    assert len(results) == 1 and results[0].done and results[0].reward == 1.0


# -- bad input fails the sample with the reason ------------------------------------------------------------


@pytest.mark.parametrize("case, error, message", [
    ("no_tests", TaskError, r"task 'bad': no tests/test\.sh"),
    ("bad_toml", TaskError, r"task 'bad': task\.toml is not valid TOML"),
    ("bad_timeout", TaskError, r"\[verifier\] timeout_sec: expected a positive number of seconds, got 'soon'"),
    ("shell", TaskError, r"Dockerfile line 2: SHELL is not supported"),
    ("failing_run", SetupError, r"line 3: RUN 'apt-get install -y cowsay' exited with code \d+ .*no network"),
    ("steps", TaskError, r"multi-step tasks"),
    ("workdir_on_host", ValueError, r"cannot give the task its folders .*'/opt/app'.*/opt exists on this machine"),
    ("no_reward", VerifierError, r"wrote no reward .*exited with code 2; its output ends: boom"),
    ("bad_reward", VerifierError, r"reward\.txt holds 'great', expected a number"),
    ("bad_json", VerifierError, r"reward\.json: expected a number or an object of named numbers"),
])
def test_a_broken_task_fails_with_the_reason(tmp_path: Path, case: str, error: type, message: str) -> None:
    reward_file = "#!/bin/bash\necho {} > /logs/verifier/{}\n"
    variants = {
        "no_tests": dict(test=None),
        "bad_toml": dict(toml="[verifier\ntimeout_sec = 1"),
        "bad_timeout": dict(toml='[verifier]\ntimeout_sec = "soon"\n'),
        "shell": dict(dockerfile='FROM ubuntu\nSHELL ["/bin/bash", "-c"]\n'),
        "failing_run": dict(dockerfile="FROM ubuntu\nWORKDIR /app\nRUN apt-get install -y cowsay\n"),
        "steps": dict(toml=TOML + '\n[[steps]]\nname = "one"\n'),
        "workdir_on_host": dict(dockerfile="FROM ubuntu\nWORKDIR /opt/app\n"),
        "no_reward": dict(test="#!/bin/bash\necho boom\nexit 2\n"),
        "bad_reward": dict(test=reward_file.format("great", "reward.txt")),
        "bad_json": dict(test=reward_file.format("'[1, 2]'", "reward.json")),
    }
    write_task(tmp_path, "bad", **variants[case])
    with pytest.raises(error, match=message):
        play("bad", [], tasks=tmp_path)


def test_a_sample_without_a_known_task_fails() -> None:
    with pytest.raises(ValueError, match=r"unknown Harbor task 'nope'; the configured tasks are: create-file, fix-bug"):
        play("nope", [])
    with pytest.raises(ValueError, match=r"names no Harbor task: expected its data row's 'task' field or its label"):
        play("", [], sample=task_sample(""))


def test_without_a_sandbox_the_sample_fails() -> None:
    async def main() -> None:
        await HarborEnv(EnvContext(), str(TASKS)).reset(task_sample("fix-bug"))

    with pytest.raises(RuntimeError, match="needs a sandbox: set rollout.sandbox"):
        asyncio.run(main())


# -- config checks (exit 2 at start) and the data generator ---------------------------------------------------


def test_check_args_names_the_bad_argument(tmp_path: Path) -> None:
    write_task(tmp_path / "a", "same")
    write_task(tmp_path / "b", "same")
    (tmp_path / "empty").mkdir()
    for args, message in [
        ({"tasks": str(tmp_path / "missing")}, "tasks: .*missing' is not a directory"),
        ({"tasks": str(tmp_path / "empty")}, "tasks: .*empty' holds no Harbor task"),
        ({"tasks": [str(tmp_path / "a"), str(tmp_path / "b")]}, "tasks: two tasks are named 'same'"),
        ({"tasks": 3}, "tasks: expected a directory"),
        ({"tasks": str(TASKS), "command_timeout_s": 0}, "command_timeout_s: expected a positive number"),
        ({"tasks": str(TASKS), "max_turns": -1}, "max_turns: expected an integer >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            HarborEnv.check_args(args)
    HarborEnv.check_args({"tasks": [str(TASKS / "fix-bug"), str(tmp_path / "a")]})  # task dirs and folders mix


def test_a_config_with_a_missing_tasks_dir_exits_2(tmp_path: Path) -> None:
    """`miles config` on the example config with a tasks folder that does not exist exits 2 naming it (Miles'
    config validation calls the env's check_args); the config as shipped runs in the training test below."""
    run = subprocess.run([*MILES_WITH_CTRL_C, "config", str(CONFIG), f"rollout.env.tasks={tmp_path / 'none'}"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 2, run.stderr
    assert "env 'harbor' rejected its arguments: tasks:" in run.stderr and "is not a directory" in run.stderr


def test_the_data_generator_writes_a_row_per_task() -> None:
    splits = harbor_tasks(0, str(TASKS), eval_tasks=["partial-credit"])
    assert [row["task"] for row in splits["train"]] == ["create-file", "fix-bug"]
    assert splits["eval"] == [{"prompt": INSTRUCTIONS["partial-credit"], "label": "partial-credit",
                               "task": "partial-credit"}]
    assert "eval" not in harbor_tasks(0, [str(TASKS)])
    with pytest.raises(ValueError, match="eval_tasks: nope not among the tasks"):
        harbor_tasks(0, str(TASKS), eval_tasks=["nope"])


@pytest.mark.slow
def test_a_training_run_on_the_tasks(tmp_path: Path) -> None:
    """`miles train` with the example config for one step, on the shipped tasks plus a broken one: the
    generator's rows reach the env, every trajectory gets the verifier's reward, and the broken task fails
    only its own samples (2 of 8; the reasons are checked above, Miles does not print them)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name in NAMES:
        (tasks / name).symlink_to(TASKS / name)
    write_task(tasks, "broken", test=None)
    config = yaml.safe_load(CONFIG.read_text())
    config["data"]["generator"]["tasks"] = config["rollout"]["env"]["tasks"] = str(tasks)
    config["rollout"].update(prompts_per_step=4, n_samples=2)
    config["run"].update(steps=1, dir=str(tmp_path / "run"), progress=False)
    path = tmp_path / "harbor.yaml"
    path.write_text(yaml.safe_dump(config))
    run = subprocess.run([*MILES_WITH_CTRL_C, "train", str(path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["samples/total"] == 8 and metrics[0]["samples/failed"] == 2


@pytest.mark.slow
def test_the_retool_recipe_runs_with_the_harbor_tasks_as_its_env(tmp_path: Path) -> None:
    """configs/retool.yaml with its env and data swapped for the Harbor task set: the recipe's stack (multi_turn,
    the python_block parser, the local sandbox, GRPO) drives Harbor tasks, and every trajectory is graded by
    its task's verifier. The overrides are what such a swap needs: a tokenizer that covers the instructions,
    room for them, the parser calling the tasks' `bash` tool, the verifier's reward, no arithmetic warm-up."""
    alphabet = "".join(chr(c) for c in range(32, 127)) + "\n"
    overrides = [
        f"run.dir={tmp_path / 'run'}", "run.steps=1", "run.eval_size=0", "run.progress=false", "sft.steps=0",
        f"rollout.env={{name: harbor, tasks: {TASKS}}}", f"data.generator={{name: harbor_tasks, tasks: {TASKS}}}",
        "rollout.tool_parser={name: python_block, tool: bash, argument: command}", "reward={name: env}",
        f"model.tokenizer.alphabet={json.dumps(alphabet)}", "model.build.max_position_embeddings=2048",
        "rollout.fn.max_total_tokens=1024", "rollout.prompts_per_step=3", "rollout.n_samples=2",
    ]
    run = subprocess.run([*MILES_WITH_CTRL_C, "train", str(ROOT / "configs" / "retool.yaml"), *overrides],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    [metrics] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["samples/total"] == 6 and metrics["samples/failed"] == 0, metrics
