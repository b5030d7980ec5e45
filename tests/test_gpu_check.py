"""scripts/gpu_check.sh --dry-run: every check of the GPU script runs here on CPU with tiny sizes, so the
script is known to work before a GPU is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_prints_one_summary_with_every_check(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    summary = json.loads(done.stdout)
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == summary
    checks = summary["checks"]
    assert summary["dry_run"] is True
    assert list(checks) == ["environment", "quickstart", "engine_decode", "train_throughput", "weight_sync",
                            "megatron_conformance", "logprob_kernels", "sglang_run", "precision",
                            "sglang_precision", "speculative", "sglang_speculative"]
    failed = {name: c for name, c in checks.items() if c["status"] not in ("ok", "skipped")}
    assert not failed, json.dumps(failed, indent=1)[-4000:]
    assert done.returncode == 0 and summary["ok"] is True
    assert checks["environment"]["cuda_available"] is False
    assert checks["quickstart"]["steps"] == 4
    assert checks["engine_decode"]["tokens"] == 4 * 8 and checks["engine_decode"]["decode_tokens_per_s"] > 0
    assert checks["train_throughput"]["tokens_per_step"] == 4 * 16
    for transport in ("tensor", "shm", "distributed_gloo"):
        assert checks["weight_sync"][f"{transport}_mb"] > 0
    kernels = checks["logprob_kernels"]
    assert "triton" in kernels.get("skipped", "") or (kernels["backend"] == "interpreter"
                                                      and kernels["max_abs_diff"] <= 1e-5)
    assert "sglang" in checks["sglang_run"].get("skipped", "") or checks["sglang_run"]["steps"] == 3
    sglang_precision = checks["sglang_precision"]
    assert "sglang" in sglang_precision.get("skipped", "") or sglang_precision["fp8_block"]["steps"] == 3
    precision = checks["precision"]
    assert precision["fp8_block_rollout"]["steps"] == 3 and precision["fp8_block_rollout"]["push_vs_bf16"] < 0.7
    assert precision["int4_rollout_qat"]["logprob_abs_diff"] * 5 < precision["int4_rollout"]["logprob_abs_diff"]
    speculative = checks["speculative"]
    assert speculative["speculative_logprob_abs_diff_max"] < 1e-4 and speculative["speculative_tokens_per_s"] > 0
    assert speculative["mtp_logprob_abs_diff_max"] < 1e-4 and speculative["mtp_tokens_per_s"] > 0
    assert "sglang" in checks["sglang_speculative"].get("skipped", "") or checks["sglang_speculative"]["steps"] == 3


def test_a_wrong_argument_is_refused_with_exit_code_2():
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--gpus", "8"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "unknown argument --gpus" in done.stderr
