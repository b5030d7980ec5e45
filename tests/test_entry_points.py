"""Plugins found through the ``miles`` entry-point group of installed distributions.

Each test lays a real distribution (a ``.dist-info`` folder with ``entry_points.txt``) on sys.path,
which is exactly what ``pip install`` leaves behind.
"""

import json
import textwrap

import pytest

from miles.errors import PluginError
from miles.plugins import build_plugin_manager
from miles.registry import Registry

GOOD = """
import miles

def shout(sample):
    return float(sample.response_text.isupper())

@miles.hookimpl
def miles_register_rewards(register):
    register("shout", shout)
"""


def install(site, dist: str, version: str, entry: str, module: str, code: str) -> None:
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[miles]\n{entry} = {module}\n")
    (site / f"{module}.py").write_text(textwrap.dedent(code))


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MILES_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    return tmp_path


def test_entry_point_plugin_is_loaded_with_its_version(site):
    install(site, "miles-shout", "0.3.1", "shout", "miles_shout_plugin", GOOD)
    pm = build_plugin_manager()
    registry = Registry.from_plugin_manager(pm)
    entry = registry.get("reward", "shout")
    assert (entry.plugin.name, entry.plugin.distribution, entry.plugin.version) == ("shout", "miles-shout", "0.3.1")
    assert not entry.builtin


def test_autoload_can_be_disabled(site, monkeypatch):
    install(site, "miles-shout", "0.3.1", "shout", "miles_shout_plugin", GOOD)
    monkeypatch.setenv("MILES_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert "shout" not in build_plugin_manager().info


def test_allow_list(site):
    install(site, "miles-shout", "0.3.1", "shout", "miles_shout_plugin", GOOD)
    install(site, "miles-whisper", "1.0", "whisper", "miles_whisper_plugin", GOOD.replace('"shout"', '"whisper"'))
    pm = build_plugin_manager(allow=["whisper"])
    assert "whisper" in pm.info and "shout" not in pm.info
    with pytest.raises(PluginError, match="not installed: nothere"):
        build_plugin_manager(allow=["nothere"])


def test_plugin_that_fails_to_import_is_named(site):
    install(site, "miles-broken", "2.0", "broken", "miles_broken_plugin", "import numpy_does_not_exist\n")
    with pytest.raises(PluginError) as err:
        build_plugin_manager()
    message = str(err.value)
    assert "Error importing plugin 'broken'" in message
    assert "miles-broken 2.0" in message and "numpy_does_not_exist" in message


def test_cli_reports_broken_plugin_with_exit_2(site, miles_cli):
    install(site, "miles-broken", "2.0", "broken", "miles_broken_plugin", "raise RuntimeError('boom at import')\n")
    result = miles_cli("plugins", env={"PYTHONPATH": str(site)})
    assert result.returncode == 2
    assert "Error importing plugin 'broken'" in result.stderr and "boom at import" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_plugins_json_lists_versions_and_registrations(site, miles_cli):
    install(site, "miles-shout", "0.3.1", "shout", "miles_shout_plugin", GOOD)
    result = miles_cli("plugins", "--json", env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert plugins["shout"]["version"] == "0.3.1"
    assert plugins["shout"]["registered"] == {"reward": ["shout"]}
    assert plugins["miles.builtin.rewards"]["registered"]["reward"] == [
        "code_tests", "env", "exact_match", "f1", "format", "math", "multiple_choice"]

    table = miles_cli("plugins", env={"PYTHONPATH": str(site)})
    assert table.returncode == 0
    line = next(line for line in table.stdout.splitlines() if line.startswith("shout "))
    assert "0.3.1" in line and "reward: shout" in line


LAZY = """
import miles

@miles.hookimpl
def miles_register_rewards(register):
    register("heavy", "miles_heavy_reward:score")  # imported when a run first uses it
    register("gone", "miles_no_such_module:score")
"""

HEAVY = """
import json  # stands for a heavy dependency: importing this module is what registering by path defers
IMPORTED = True

def score(sample, bonus: float = 0.0):
    return 1.0 + bonus
"""


def test_a_component_registered_by_its_import_path_is_imported_when_first_used(site):
    install(site, "miles-lazy", "1.0", "lazy", "miles_lazy_plugin", LAZY)
    (site / "miles_heavy_reward.py").write_text(textwrap.dedent(HEAVY))
    import sys

    registry = Registry.from_plugin_manager(build_plugin_manager())
    assert "miles_heavy_reward" not in sys.modules  # registered, listed, not imported
    assert {"heavy", "gone"} <= set(registry.names("reward"))
    # a config that names it is checked against its signature (the import happens here), then built
    assert registry.check("reward", {"name": "heavy", "bonsu": 1}, "reward") == [
        "reward.bonsu: reward 'heavy' takes no argument 'bonsu'; it accepts: bonus; did you mean 'bonus'?"]
    assert "miles_heavy_reward" in sys.modules
    assert registry.build("reward", {"name": "heavy", "bonus": 0.5}, "reward")(None) == 1.5
    # an import path that does not import names the plugin that registered it
    with pytest.raises(PluginError, match=r"plugin 'lazy' registered reward 'gone' as 'miles_no_such_module:score', "
                                          r"which does not import: ModuleNotFoundError"):
        registry.build("reward", {"name": "gone"}, "reward")
