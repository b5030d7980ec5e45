"""configs/retool.yaml end to end in miniature: SFT on tool-use traces, then multi_turn GRPO steps with
execute_python_code in the local sandbox; and a tool call that never ends. (That the recipe learns is
measured by benchmarks/retool.py; see docs/agentic.md.)"""

import asyncio
import json
import os
from pathlib import Path

from miles.agentic.tool_calls import PythonBlockParser
from miles.agentic.sandboxes.local import LocalSandbox
from miles.agentic.tool_env import ToolEnv, execute_python_code
from miles.engine.local import LocalEngine
from miles.rollout.context import RolloutContext
from miles.rollout.multi_turn import MultiTurn
from miles.run.runner import prepare, train
from miles.types import Sample, SampleStatus

from test_multi_turn import ScriptedPolicy


def _descendants() -> list[str]:
    """Command lines of every process this test process started that is still alive."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not a process
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    found, todo = [], list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return found


def test_the_recipe_runs_its_phases_with_the_real_sandbox(tmp_path):
    summary = train(prepare("configs/retool.yaml", [
        f"run.dir={tmp_path}", "sft.steps=80", "data.generator.direct_fraction=0.0", "run.steps=2",
        "rollout.prompts_per_step=4", "rollout.n_samples=4", "run.eval_size=8", "run.progress=false"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all(r["samples/failed"] == 0 for r in steps)
    assert sum(r["tools/calls"] for r in steps) > 0 and any("sandbox/exec_s_p50" in r for r in steps)
    assert all(0 < r["rollout/observation_token_frac"] < 1 for r in steps if r["turns/max"] > 1)
    assert {"sft", "rl", "eval"} <= set(summary["time_s"])
    assert not [c for c in _descendants() if "bwrap" in c or "main.py" in c]  # no sandbox outlives the run
    from miles.run.report import write_report

    report = write_report(tmp_path)  # an agentic run's report plots its tools, turns and sandboxes
    assert {"tool_calls", "tool_success", "turns", "observation_share", "sandbox_times"} <= set(report.plots)


def test_code_that_never_ends_comes_back_as_a_timeout(chat_model_dir):
    engine = LocalEngine(seed=0)
    engine.load_model(str(chat_model_dir))
    policy = ScriptedPolicy(engine, ["```python\nwhile True:\n    pass\n```", "```python\nprint(6*7)\n```", "42"])
    ctx = RolloutContext(engine=policy, tokenizer=engine.tokenizer, sampling_params={"max_new_tokens": 64},
                         context_length=512, env=lambda c: ToolEnv(c, tool_timeout_s=1), sandbox=LocalSandbox,
                         tool={"execute_python_code": execute_python_code}.__getitem__, tool_parser=PythonBlockParser())
    sample = Sample(prompt_ids=[0], prompt="6*7=")
    asyncio.run(MultiTurn(tools_in_prompt=False)(sample, ctx))
    assert (sample.status, sample.response_text, sample.turns) == (SampleStatus.COMPLETED, "42", 3)
    assert sample.metadata["tools"] == {"calls": 2, "succeeded": 1, "parse_errors": 0, "schema_errors": 0,
                                        "timeouts": 1}
    observations = [engine.tokenizer.decode(p[len(sample.prompt_ids):]) for p in policy.prompts[1:]]
    assert "<tool_response>\nerror: timed out after 1 s\n</tool_response>" in observations[0]
    assert "<tool_response>\n42\n\n</tool_response>" in observations[1]
    assert len(sample.metadata["exec_s"]) == 2


def test_the_qwen3_recipe_runs_on_a_real_bpe_vocabulary_with_thinking(tmp_path):
    """configs/retool_qwen3.yaml in miniature: a tiny model on Qwen's BPE ranks, Qwen3's format with reasoning in
    every turn; the trajectories' turns parse (tool calls run) and nothing fails on the format."""
    train(prepare("configs/retool_qwen3.yaml", [
        f"run.dir={tmp_path}", "sft.steps=30", "sft.batch_size=16", "data.generator.direct_fraction=0.0", "run.steps=2",
        "rollout.prompts_per_step=4", "rollout.n_samples=4", "run.eval_size=0", "run.progress=false",
        "run.save_rollouts=true"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["samples/failed"] == 0 for r in rows)
    assert all(r["rollout/tito_mismatch_frac"] == 0.0 for r in rows)
    from miles.models.hf import load_tokenizer
    from miles.loop.saved_rollouts import read_step

    tokenizer = load_tokenizer(tmp_path / "final_model")
    assert len(tokenizer) == 8192 + 26 and tokenizer.convert_tokens_to_ids("<|im_end|>") == 8194
    samples, _ = read_step(tmp_path / "rollouts" / "step_000001.npz")
    text = tokenizer.decode(samples[0].prompt_ids + samples[0].response_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in text
