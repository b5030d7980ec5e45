"""A short GRPO run through the ``openenv`` env: ``python -m miles train`` on the countdown of
``openenv_testenvs.py`` in process, with the tiny chat model of ``chat_model_dir`` that a short SFT warm-up
teaches the format."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

TESTS = Path(__file__).resolve().parent


def countdown_rows(count: int) -> list[dict]:
    """Prompts to count down from 2 or 3 (``start``, passed to reset), with the whole conversation for SFT."""
    rows = []
    for i in range(count):
        start = 2 + i % 2
        messages = [{"role": "user", "content": f"count down from {start}"}]
        for n in range(start, 0, -1):
            messages.append({"role": "assistant", "content": str(n)})
            if n > 1:
                messages.append({"role": "user", "content": f"say {n - 1}"})
        rows.append({"prompt": f"count down from {start}", "label": str(start), "start": start, "messages": messages})
    return rows


@pytest.mark.slow
def test_grpo_trains_on_the_env_rewards(tmp_path, chat_model_dir):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in countdown_rows(16)))
    config = {
        "model": {"path": str(chat_model_dir)},
        "data": {"train_path": str(tmp_path / "train.jsonl")},
        "sft": {"steps": 30, "batch_size": 16, "lr": 3e-3, "messages_key": "messages"},
        "rollout": {
            "fn": {"name": "multi_turn", "max_turns": 4, "tools_in_prompt": False},
            "env": {"name": "openenv", "env": "openenv_testenvs:Countdown", "env_args": {"floor": 0.25},
                    "action": "text", "observation_field": "message", "reset_fields": ["start"]},
            "prompts_per_step": 4, "n_samples": 4, "sampling": {"max_new_tokens": 4, "temperature": 1.0}},
        "reward": {"name": "env"},
        "advantage": {"name": "grpo"},
        "loss": {"name": "ppo_clip"},
        "backend": {"name": "torch", "lr": 1e-3, "micro_batch_size": 64},
        "run": {"steps": 2, "dir": str(tmp_path / "run"), "seed": 0, "eval_size": 0, "torch_threads": 1,
                "progress": False, "plugins": {"allow": ["openenv"]}},
    }
    (tmp_path / "countdown.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(TESTS), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "miles", "train", str(tmp_path / "countdown.yaml")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert row["samples/failed"] == 0
        assert row["turns/mean"] > 1, "the countdown takes 2 or 3 steps"
        # a finished countdown earns the env's floor of 0.25 and more for each number said right; a truncated one 0
        finished = 1.0 - row["rollout/truncated_frac"]
        assert finished > 0 and 0.25 * finished <= row["reward/mean"] <= finished, row
