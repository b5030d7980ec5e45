"""The public API plugin authors build on: what backend plugins may import, and what imports what."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.train import api

ROOT = Path(__file__).resolve().parents[1]
# What a training-plane plugin (a backend, log-prob kernels) may import from Miles (docs/backends.md, "Writing a
# backend").
PUBLIC = {"miles", "miles.train.api", "miles.testing"}
BACKEND_PLUGINS = ["miles-fsdp2", "miles-megatron", "miles-kernels"]


def _miles_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name == "miles" or name.startswith("miles.")}


@pytest.mark.parametrize("plugin", BACKEND_PLUGINS)
def test_backend_plugins_import_only_the_public_api(plugin):
    # The package's own code (its tests may also compare with the builtin backend or run the runner).
    sources = [p for p in (ROOT / "plugins" / plugin).rglob("*.py") if not {".venv", "tests"} & set(p.parts)]
    if not sources:
        pytest.skip(f"{plugin} is not in this checkout")
    private = {f"{p.relative_to(ROOT)}: {name}" for p in sources for name in _miles_imports(p) - PUBLIC}
    assert not private, f"backend plugins import only {sorted(PUBLIC)}; found: {sorted(private)}"


def test_the_api_module_exports_what_it_lists():
    assert sorted(api.__all__) == sorted(set(api.__all__))
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert not missing
    for name in ("Policy", "plan_batch", "sum_over_ranks", "combine_metrics", "assemble_rows", "value_loss",
                 "rng_state", "TrainOptions", "TrainBackend", "TorchKernel", "select_kernel", "check_kernel_name"):
        assert name in api.__all__


def _imported_after(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    return out.stdout.split()


def test_the_training_plane_does_not_import_the_engine():
    modules = _imported_after("import miles.train.api, miles.weights.transports, miles.builtin.backends")
    assert "miles.weights.wire" in modules and "miles.weights.shm" in modules  # the shared wire format
    assert not [m for m in modules if m.startswith("miles.engine")]


def test_miles_testing_imports_without_pytest():
    blocker = ("import sys\nclass _NoPytest:\n    def find_spec(self, name, path=None, target=None):\n"
               "        if name == 'pytest' or name.startswith(('pytest.', '_pytest')):\n"
               "            raise ImportError('pytest is not installed here')\n"
               "sys.meta_path.insert(0, _NoPytest())\n"
               "import miles.testing as t\nassert t.pytest is None\n"
               "batch = t.make_train_batch()\nassert batch.input_ids.shape[0] > 0")
    modules = _imported_after(blocker)
    assert "miles.testing" in modules and "pytest" not in modules


def test_value_loss_clips_against_the_old_values():
    values = torch.tensor([[1.0, 3.0, 0.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = api.value_loss(values, old, returns, mask, normalizer=2.0, clip=0.5)
    # token 0: max((1-2)^2, (0.5-2)^2) = 2.25; token 1: max(9, 0.25) = 9; token 2 masked out
    assert float(loss) == pytest.approx(0.5 * (2.25 + 9.0) / 2.0)
    assert metrics["critic/clip_frac"] == pytest.approx(1.0)  # both unmasked tokens moved more than 0.5
    assert metrics["critic/value_mean"] == pytest.approx((1.0 + 3.0) / 2.0)
    unclipped, metrics = api.value_loss(values, old, returns, mask, normalizer=2.0)
    assert float(unclipped) == pytest.approx(0.5 * (1.0 + 9.0) / 2.0) and "critic/clip_frac" not in metrics
