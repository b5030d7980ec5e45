"""Commands that only look or validate (``miles --help``, ``miles plugins``, ``miles config``) and ``import miles``
import none of the heavy packages: every installed plugin registers its components by import path, and the
components a config names import their dependencies when first used (``miles.lazy``).

Each check runs in a fresh interpreter and reads its ``sys.modules``; times are in benchmarks/startup.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "ray", "datasets", "numpy", "aiohttp", "tokenizers")

PROBE = """
import contextlib, io, json, sys
{body}
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""

CLI = """
from miles.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main({argv!r})
    except SystemExit as exit:
        assert exit.code in (0, None), exit.code
"""


def heavy_modules(body: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(body=body, heavy=HEAVY)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_miles_imports_no_heavy_package():
    assert heavy_modules("import miles; from miles import Sample, Group, TrainBatch, hookimpl, tool") == []


@pytest.mark.parametrize("argv", [["--help"], ["plugins"], ["plugins", "--json"], ["train", "--help"]])
def test_looking_commands_import_no_heavy_package(argv):
    assert heavy_modules(CLI.format(argv=argv)) == []


@pytest.mark.parametrize("config", sorted(str(path) for path in Path("configs").glob("*.yaml")))
def test_miles_config_validates_every_bundled_config_without_heavy_packages(config):
    """Plain ``miles config`` reads each component's arguments and checks the backend's options; ``--check``, which
    loads the model and the data, is the one that imports torch."""
    assert heavy_modules(CLI.format(argv=["config", config])) == []


@pytest.mark.parametrize("overrides", [["backend.name=fsdp2"], ["backend.name=megatron"],
                                       ["backend.logprob_kernel=triton"],
                                       ["rollout.engine.name=sglang", "rollout.engine.num_engines=1"]])
def test_miles_config_stays_light_with_the_bundled_plugins_components(overrides):
    """The plugins' backends, kernel and engine import torch and their libraries when they start, not when read."""
    assert heavy_modules(CLI.format(argv=["config", "configs/quickstart.yaml", *overrides])) == []


def test_every_installed_plugin_registers_without_importing_heavy_packages():
    body = ("from miles.plugins import build_plugin_manager\nfrom miles.registry import Registry\n"
            "pm = build_plugin_manager()\nregistry = Registry.from_plugin_manager(pm)\n"
            "assert len(pm.info) > 15, sorted(pm.info)")
    assert heavy_modules(body) == []


def test_a_train_batch_still_builds_its_tensors():
    """The types import torch where they use it."""
    from miles import Sample, TrainBatch

    batch = TrainBatch.from_samples([Sample([1, 2], response_ids=[3], loss_mask=[1], rollout_logprobs=[-0.5])], 0)
    assert batch.input_ids.tolist() == [[1, 2, 3]] and batch.loss_mask.tolist() == [[0.0, 1.0]]
    assert len(batch.select([0])) == 1


REFUSED = """
from miles.cli import main
err = io.StringIO()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
    code = main({argv!r})
print(json.dumps([code, err.getvalue()]))
"""


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.n_sample=8"], "rollout.n_sample"),  # a misspelt key
    (["backend.mini_batches=3"], "backend.mini_batches=3 does not divide rollout.prompts_per_step=16"),
    (["run.dir=README.md"], "run.dir 'README.md' is a file"),  # a run directory that cannot be one
    (["data.train_path=/nowhere/train.jsonl"], "data.train_path: data file '/nowhere/train.jsonl' does not exist"),
    (["data.eval_path=README.md"], "data.eval_path: data file 'README.md': unsupported extension '.md'"),
    (["model.path=/nowhere/model"], "model.path '/nowhere/model': no such directory, nor a Hugging Face Hub model id"),
    (["model.path=configs"], "model.path 'configs' is not an HF model directory (no config.json there)"),
    (["reward.name=nope"], "unknown reward 'nope' (at reward.name)"),  # a plugin name that is registered nowhere
])
def test_miles_train_refuses_a_config_before_importing_torch(overrides, message):
    """What ``miles config`` checks, ``miles train`` checks first: a typo, a wrong path or an unknown plugin name
    costs a second, not torch's import (counted by what was imported, not by a clock)."""
    assert _refused(["train", "configs/quickstart.yaml", *overrides], message) == []


@pytest.mark.parametrize(("argv", "message"), [
    (["configs/quickstart.yaml", "rollout.n_sample=8"], "rollout.n_sample"),
    (["configs/quickstart.yaml", "data.train_path=/nowhere/train.jsonl"], "data file '/nowhere/train.jsonl' does"),
    (["configs/quickstart.yaml", "reward.name=nope"], "unknown reward 'nope' (at reward.name)"),
    (["--model", "/nowhere/model", "configs/quickstart.yaml"], "--model '/nowhere/model': no such directory"),
])
def test_miles_eval_refuses_a_config_before_importing_torch(tmp_path, argv, message):
    argv = argv if "--model" in argv else ["--model", "configs", *argv]  # a folder: the model is not looked at
    assert _refused(["eval", *argv], message) == []


def _refused(argv, message):
    """The heavy packages imported by the time ``argv`` exited 2 with ``message``."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(body=REFUSED.format(argv=argv), heavy=HEAVY)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (code, err), heavy = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert code == 2 and message in err, err
    return heavy
