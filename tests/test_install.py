"""``pip install miles`` beside an inference stack: the torch a venv holds is kept (Miles' dependencies are ranges).

The venv's torch is a stand-in: a distribution record of torch 2.9.1 (the release SGLang pins; a real one is a
CUDA build of several GB from PyPI, which this test does not download). pip's resolver reads only that record, so
what the test checks, whether pip would keep it or replace it, is exactly what a real one would give. pip resolves
Miles' other dependencies from the package index (metadata only: ``--dry-run``)."""

import json
import subprocess
import venv

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def stand_in(site, name: str, version: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


@pytest.fixture
def env_with_torch(tmp_path_factory):
    root = tmp_path_factory.mktemp("venv")
    venv.create(root, with_pip=True)
    site = next(root.glob("lib/python*/site-packages"))
    stand_in(site, "torch", "2.9.1")
    return root


def plan(env, *requirements: str) -> dict[str, str]:
    """What ``pip install`` would install into ``env``: {name: version}."""
    report = env / "report.json"
    out = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "--dry-run", "--quiet",
                          "--report", str(report), *requirements], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


def test_pip_install_miles_keeps_the_torch_the_venv_holds(env_with_torch):
    """Miles with its training plugin (which needs torch too)."""
    wanted = plan(env_with_torch, str(ROOT), str(ROOT / "plugins" / "miles-fsdp2"))
    assert {"miles", "miles-fsdp2", "transformers", "ray"} <= set(wanted)  # it resolved the rest
    assert "torch" not in wanted, f"pip would replace the venv's torch 2.9.1 with {wanted['torch']}"


def test_the_constraints_file_pins_what_the_ranges_admit():
    """constraints.txt (the tested set) satisfies pyproject's ranges: an install with it cannot fail to resolve."""
    import tomllib

    from packaging.requirements import Requirement

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.lower().replace("_", "-")] = version
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in map(Requirement, dependencies):
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, f"constraints.txt pins no {name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (requirement, pins[name])
