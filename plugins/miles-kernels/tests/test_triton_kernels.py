"""The ``triton`` kernel against Miles' ``torch`` kernel, forward and backward, and how Miles picks it.

The numerical checks run wherever the kernel can: on a GPU when one is present, and on CPU through
Triton's interpreter (``TRITON_INTERPRET=1``, in a process of its own: ``triton.jit`` reads it at import).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from miles.testing import make_registry
from miles.train.api import ConfigError, TorchKernel, check_kernel_name, select_kernel
from miles_kernels import TritonKernel, plugin
from miles_kernels.kernel import gpu_backend

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")


def _check_results(result: dict, tolerance: float) -> None:
    assert result["ok"], json.dumps(result, indent=1)
    assert result["max_abs_diff"] <= tolerance
    cases = result["cases"]
    # vocabularies that are not a multiple of the block, several blocks per row, the chunked path on a model
    assert {"rows=5 vocab=37 block=16", "rows=7 vocab=100 block=32", "tiny qwen3, chunk 5"} <= set(cases)
    for case in cases.values():
        assert case and all(0 <= diff <= tolerance for diff in case.values()), case


@needs_triton
def test_kernels_equal_the_torch_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "miles_kernels.reference_check", "--device", "cpu"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == "interpreter"
    _check_results(result, 1e-5)


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")
def test_kernels_equal_the_torch_reference_on_the_gpu():
    from miles_kernels import reference_check

    result = reference_check.run("cuda")
    assert result["backend"] == gpu_backend()
    _check_results(result, 1e-4)


# -- availability and selection (no kernel runs: these hold with or without triton) ---------------------


@needs_triton
def test_unavailable_says_why(monkeypatch):
    kernel = TritonKernel()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in kernel.unavailable(torch.device("cpu"))
    assert "not mps" in kernel.unavailable(torch.device("mps"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernel.unavailable(torch.device("cpu")) is None
    assert "CPU tensors only" in kernel.unavailable(torch.device("cuda"))


def test_unavailable_without_triton(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "triton" else "found")
    for device in ("cpu", "cuda"):
        assert TritonKernel().unavailable(torch.device(device)).startswith("triton is not installed")


def test_rocm_is_told_apart_from_cuda(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    assert gpu_backend() == "rocm"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert gpu_backend() == "cuda"


def test_the_plugin_registers_triton():
    entry = make_registry(plugin).get("logprob_kernel", "triton")
    assert entry.obj is TritonKernel and not entry.builtin


@needs_triton
def test_auto_picks_triton_where_it_runs_and_torch_elsewhere(monkeypatch):
    registry = make_registry(plugin)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert type(select_kernel("auto", "cpu", registry)) is TorchKernel
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert type(select_kernel("auto", "cpu", registry)) is TritonKernel
    assert type(select_kernel("triton", "cpu", registry)) is TritonKernel


def test_a_named_kernel_that_cannot_run_falls_back_with_one_warning(monkeypatch, caplog):
    from miles.train import kernels

    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    registry = make_registry(plugin)
    with caplog.at_level(logging.WARNING, logger="miles.train.kernels"):
        assert type(select_kernel("triton", "cpu", registry)) is TorchKernel
        assert type(select_kernel("triton", "cpu", registry)) is TorchKernel
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("backend.logprob_kernel: kernel 'triton' cannot run on cpu (")
    assert ("TRITON_INTERPRET=1" if HAS_TRITON else "triton is not installed") in warnings[0]


def test_unknown_names_are_config_errors():
    registry = make_registry(plugin)
    with pytest.raises(ConfigError, match=r"unknown log-prob kernel 'tritn'; known: auto, torch, triton; did you "
                                          r"mean 'triton'\?"):
        check_kernel_name("tritn", registry)
    check_kernel_name("triton", registry)


def test_the_kernel_refuses_logits_it_cannot_read():
    with pytest.raises(ValueError, match="float32 logits with contiguous rows"):
        TritonKernel().forward(torch.zeros(3, 8, dtype=torch.float16), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="power of two"):
        TritonKernel(block=100)
