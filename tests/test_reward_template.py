"""The contrib reward template installed as a real package, then selected by name in a training run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

TEMPLATE = ROOT / "contrib" / "miles-reward-template"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``pip install`` the template into its own folder (leaving this environment as it was)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(TEMPLATE)],
        check=True, capture_output=True, text=True,
    )
    return {"PYTHONPATH": str(target)}


def test_template_own_tests_pass(installed):
    env = {**os.environ, **installed}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TEMPLATE / "tests")],
                            cwd=TEMPLATE, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "passed" in result.stdout


def test_plugins_lists_the_installed_template(installed, miles_cli):
    result = miles_cli("plugins", "--json", env=installed)
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert plugins["reward-template"] == {
        "name": "reward-template", "version": "0.1.0", "distribution": "miles-reward-template",
        "module": "miles_reward_template.plugin", "builtin": False, "registered": {"reward": ["numeric_closeness"]},
    }


def test_training_with_the_template_reward_by_name(installed, miles_cli, tmp_path):
    result = miles_cli("train", "configs/quickstart.yaml", f"run.dir={tmp_path}", "run.progress=false",
                       "run.steps=40", "reward.name=numeric_closeness", "reward.scale=4", env=installed)
    assert result.returncode == 0, result.stderr[-3000:]
    header = json.loads((tmp_path / "run.json").read_text())
    assert {"name": "reward-template", "version": "0.1.0"}.items() <= next(
        p for p in header["plugins"] if p["name"] == "reward-template").items()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "reward/mean" in line]
    assert len(rows) == 40
    # Partial credit: the mean reward is not a multiple of 1/128 as exact match would give.
    assert any((row["reward/mean"] * 128) % 1 > 1e-6 for row in rows)
    assert all(row["samples/failed"] == 0 for row in rows)
