"""The import contracts of setup.cfg (import-linter) hold on the tree, and break on a forbidden import.

Each broken case copies the package to a temporary folder that comes first on the path, adds one import that
a contract forbids, and runs ``lint-imports`` on it: the contract named in the output must break.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (the test extra)")


def lint(pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    """``lint-imports`` with this repository's contracts; with ``pythonpath``, run from there (which then comes
    first on the path, ahead of the installed packages)."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath) if pythonpath else ""}
    return subprocess.run([str(LINT_IMPORTS), str(ROOT / "setup.cfg"), "--no-cache"], cwd=pythonpath or ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def with_import(tmp_path: Path, package: Path, module: str, line: str) -> Path:
    """A copy of ``package`` under ``tmp_path`` whose ``module`` (a path inside it) starts with ``line``."""
    copy = tmp_path / package.name
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.jinja", "*.json", "*.txt"))
    target = copy / module
    target.write_text(f"{line}  # added by tests/test_layers.py\n" + target.read_text())
    return tmp_path


def test_the_contracts_hold_on_the_tree():
    result = lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 4 kept, 0 broken." in result.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("train/options.py", "import miles.rollout.plane",
     "The training plane (train, weights) imports neither the rollout plane nor the"),
    ("weights/fleet.py", "from miles.builtin import losses",
     "The training plane (train, weights) imports neither the rollout plane nor the"),
    ("rollout/collect.py", "import miles.train.torch_backend",
     "The rollout plane (rollout, engine, session) does not import the training plane"),
    ("types.py", "import miles.config.schema", "Each layer of miles imports only the layers below it"),
    ("engine/router.py", "import miles.rewards.scoring", "Each layer of miles imports only the layers below it"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, line, broken):
    result = lint(with_import(tmp_path, ROOT / "miles", module, line))
    assert result.returncode == 1, result.stdout + result.stderr
    contract = result.stdout[result.stdout.index("Broken contracts"):]
    assert broken in " ".join(contract.split()), contract


def test_a_plugin_importing_a_private_module_breaks_the_public_api_contract(tmp_path):
    package = ROOT / "plugins" / "miles-sglang" / "miles_sglang"
    result = lint(with_import(tmp_path, package, "launcher.py", "from miles.engine.launchers import EmbeddedLauncher"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "miles_sglang is not allowed to import miles.engine.launchers" in result.stdout
    assert "miles_sglang.launcher -> miles.engine.launchers" in result.stdout
    assert "Plugin packages import only the public author modules" in " ".join(result.stdout.split())


def test_no_module_of_miles_is_over_500_lines_and_the_runner_stays_thin():
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
             for path in (ROOT / "miles").rglob("*.py")}
    # The hook reference is one module by design (DESIGN.md: every hookspec in one module, each optional
    # capability next to its hookspec), declarations and their documentation: it grows with the capabilities.
    reference = sizes.pop("miles/hookspecs.py")
    assert not {path: n for path, n in sizes.items() if n > 500}, "split the module by what it holds"
    assert reference <= 700, "the hook reference grew past what one page of docs/hooks.md should hold"
    assert sizes["miles/run/runner.py"] <= 250, "the runner keeps the phases; assembly lives with each plane"
