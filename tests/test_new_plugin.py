"""`miles new plugin NAME --kind KIND`: each kind's package builds and installs offline, passes its own tests, is
listed by `miles plugins` and selected by the README's config; names that are taken and folders that hold files are
refused without writing anything."""

import ast
import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from miles.cli import main
from miles.scaffold import KINDS, MAX_NAME_CHARS

ROOT = Path(__file__).resolve().parent.parent
# What a plugin package may import from Miles (docs/plugins.md), besides the standard library, pytest and itself.
PUBLIC = {"miles", "miles.agentic", "miles.train.api", "miles.engine.api", "miles.testing"}


def dist_name(kind):
    return "my-" + kind.replace("_", "-")


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """Every kind scaffolded by the command, then built and installed without network in one pip run, into a folder
    of its own that the tests put on PYTHONPATH (this environment stays as it was)."""
    root, site = tmp_path_factory.mktemp("new-plugins"), tmp_path_factory.mktemp("site")
    for kind in KINDS:
        assert main(["new", "plugin", dist_name(kind), "--kind", kind, "--dir", str(root)]) == 0
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                                "--no-index", "--target", str(site), *(str(root / dist_name(k)) for k in KINDS)],
                               capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return root, site


@pytest.mark.parametrize("kind", KINDS)
def test_the_package_s_own_tests_pass_once_installed(kind, packages):
    root, site = packages
    folder = root / dist_name(kind)
    module = dist_name(kind).replace("-", "_")
    assert {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} >= {
        "pyproject.toml", "README.md", f"{module}/__init__.py", f"{module}/plugin.py", "tests/test_plugin.py"}
    for path in folder.rglob("*.py"):
        imported = {alias.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Import)
                    for alias in node.names} | {node.module for node in ast.walk(ast.parse(path.read_text()))
                                                if isinstance(node, ast.ImportFrom)}
        assert {m for m in imported if m.split(".")[0] == "miles"} <= PUBLIC, path
        if path.name == "plugin.py":
            assert imported == {"miles"}, imported  # nothing heavy: `miles plugins` imports it
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--line-length", "120",
                           "--select", "E,F,W", str(folder)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout[-3000:]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=folder,
                            env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", result.stdout) and " skipped" not in result.stdout, result.stdout[-2000:]


def test_miles_plugins_lists_every_installed_package(packages, miles_cli):
    _, site = packages
    result = miles_cli("plugins", "--json", env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr[-3000:]
    listed = {p["name"]: p for p in json.loads(result.stdout)}
    for kind in KINDS:
        dist, name = dist_name(kind), dist_name(kind).replace("-", "_")
        assert listed[dist] == {"name": dist, "version": "0.1.0", "distribution": dist, "module": f"{name}.plugin",
                                "builtin": False, "registered": {kind: [name]}}


def _overrides(node, prefix=""):
    """A YAML config snippet as command-line overrides: each component node (or list) set whole."""
    for key, value in node.items():
        if isinstance(value, dict) and "name" not in value:
            yield from _overrides(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}={json.dumps(value)}"


@pytest.mark.parametrize("kind", KINDS)
def test_the_readme_s_config_and_command_select_it(kind, packages, monkeypatch):
    """Both ways the README selects the component validate, against the installed package found by entry point."""
    from miles.config.prepared import prepare

    root, site = packages
    monkeypatch.syspath_prepend(str(site))
    readme = (root / dist_name(kind) / "README.md").read_text()
    snippet = re.search(r"```yaml\n(.*?)```", readme, re.S).group(1)
    config, *overrides = shlex.split(re.search(r"```bash\nmiles train (.*?)\n```", readme, re.S).group(1))
    assert dist_name(kind).replace("-", "_") in snippet and "pip install -e ." in readme
    prepared = prepare(str(ROOT / config), overrides)
    assert prepared.registry.get(kind, dist_name(kind).replace("-", "_")).plugin.name == dist_name(kind)
    prepare(str(ROOT / config), list(_overrides(yaml.safe_load(snippet))))


@pytest.mark.parametrize(("name", "kind", "message"), [
    ("my reward", "reward", "expected a distribution name"),
    ("-reward", "reward", "expected a distribution name"),
    ("reward-", "reward", "expected a distribution name"),
    ("my.reward", "reward", "expected a distribution name"),
    ("1reward", "reward", "expected a distribution name"),
    ("class", "reward", "which Python or the package's own tests/ folder takes"),
    ("my-reward", "critic", "--kind 'critic': expected one of reward, env, tool, advantage, loss, data_selector"),
    ("math", "reward", "reward 'math' (the name derived from 'math') is registered already, by the builtin plugin "
                       "'miles.builtin.rewards'"),
    ("ppo-clip", "loss", "loss 'ppo_clip' (the name derived from 'ppo-clip') is registered already, by the builtin "
                         "plugin 'miles.builtin.losses'"),
    ("tool_env", "env", "env 'tool_env' (the name derived from 'tool_env') is registered already, by the builtin "
                        "plugin 'miles.builtin.tools'"),
    ("numeric-closeness", "reward", "registered by the example package contrib/miles-reward-template"),
    ("json", "loss", "a module named 'json' exists already"),
    ("pluggy", "loss", "a distribution named 'pluggy' is installed already"),
])
def test_a_bad_or_taken_name_is_refused_and_nothing_written(name, kind, message, tmp_path, capsys):
    assert main(["new", "plugin", "--kind", kind, "--dir", str(tmp_path), "--", name]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_name_too_long_for_a_file_system_is_refused_naming_the_limit(tmp_path, capsys):
    name = "a" + "b" * 299
    assert main(["new", "plugin", name, "--kind", "reward", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"plugin name {name[:20]}... (300 characters): expected at most {MAX_NAME_CHARS} characters" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []
    longest = "a" * MAX_NAME_CHARS
    assert main(["new", "plugin", longest, "--kind", "reward", "--dir", str(tmp_path)]) == 0
    assert (tmp_path / longest / longest / "plugin.py").is_file()


def test_a_folder_that_cannot_be_written_is_refused_naming_it(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    where = tmp_path / "notes.txt" / "plugins"  # below a file: no folder can be made there
    assert main(["new", "plugin", "unwritten-reward", "--kind", "reward", "--dir", str(where)]) == 2
    err = capsys.readouterr().err
    assert f"--dir {where}: cannot write the package there (Not a directory); nothing was written" in err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_names_of_installed_plugins_are_refused(packages, miles_cli, tmp_path):
    _, site = packages
    taken = miles_cli("new", "plugin", "my_reward", "--kind", "reward", "--dir", str(tmp_path),
                      env={"PYTHONPATH": str(site)})
    assert taken.returncode == 2
    assert "reward 'my_reward' (the name derived from 'my_reward') is registered already, by the plugin " \
           "'my-reward' (my-reward 0.1.0)" in taken.stderr
    plugin = miles_cli("new", "plugin", "my-reward", "--kind", "loss", "--dir", str(tmp_path),
                       env={"PYTHONPATH": str(site)})
    assert plugin.returncode == 2 and "a plugin named 'my-reward' is installed already" in plugin.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_holds_files_is_never_overwritten(tmp_path, capsys):
    (tmp_path / "my-reward").mkdir()
    (tmp_path / "my-reward" / "notes.txt").write_text("mine")
    assert main(["new", "plugin", "my-reward", "--kind", "reward", "--dir", str(tmp_path)]) == 2
    assert "exists and is not an empty folder; nothing was written" in capsys.readouterr().err
    assert [p.name for p in tmp_path.rglob("*")] == ["my-reward", "notes.txt"]
    assert (tmp_path / "my-reward" / "notes.txt").read_text() == "mine"


def test_an_empty_folder_is_filled_and_the_next_steps_printed(tmp_path, capsys):
    (tmp_path / "fresh-loss").mkdir()
    assert main(["new", "plugin", "fresh-loss", "--kind", "loss", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'fresh-loss'}: a plugin registering the loss 'fresh_loss'" in out
    assert "miles train configs/quickstart.yaml loss.name=fresh_loss" in out
    assert (tmp_path / "fresh-loss" / "fresh_loss" / "plugin.py").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh-loss"]  # no staging folder left behind


def test_the_help_names_every_kind(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["new", "plugin", "--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert [kind for kind in KINDS if kind not in text] == []


def test_the_templates_ship_with_the_package():
    """The package-data globs of pyproject.toml cover every template file (a wheel leaves out what they miss)."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["miles.scaffold"]
    folder = ROOT / "miles" / "scaffold"
    files = [p.relative_to(folder).as_posix() for p in (folder / "templates").rglob("*") if p.is_file()]
    assert len(files) >= 2 * len(KINDS)
    assert [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)] == []
