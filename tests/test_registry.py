from pathlib import Path

import pytest

import miles
from miles.errors import ConfigError, PluginError
from miles.plugins import DEFAULT_PLUGINS, build_plugin_manager
from miles.registry import KINDS, Registry
from miles.testing import make_registry, make_sample


def my_reward(sample, bonus: float = 0.0):
    return 1.0 + bonus


class RewardPlugin:
    @miles.hookimpl
    def miles_register_rewards(self, register):
        register("my_reward", my_reward)


def test_builtins_register_through_plugin_path():
    pm = build_plugin_manager(autoload=False)
    assert [name for name in pm.info] == list(DEFAULT_PLUGINS)
    registry = Registry.from_plugin_manager(pm)
    entry = registry.get("reward", "exact_match")
    assert entry.builtin and entry.plugin.name == "miles.builtin.rewards" and entry.plugin.version == miles.__version__


def test_fresh_manager_per_run():
    first, second = build_plugin_manager(autoload=False), build_plugin_manager(autoload=False)
    assert first is not second
    make_registry(RewardPlugin())  # registering a plugin in one manager leaves the others alone
    assert "my_reward" not in Registry.from_plugin_manager(build_plugin_manager(autoload=False)).names("reward")


def test_plugin_registers_and_builds_with_args():
    registry = make_registry(RewardPlugin())
    reward = registry.build("reward", {"name": "my_reward", "bonus": 0.5}, "reward")
    assert reward(make_sample()) == 1.5
    assert registry.get("reward", "my_reward").plugin.name == "test-plugin-0"


def test_duplicate_names_are_an_error_naming_both_plugins():
    with pytest.raises(PluginError) as err:
        make_registry(RewardPlugin(), RewardPlugin())
    message = str(err.value)
    assert "'my_reward' is registered twice" in message
    assert "test-plugin-0" in message and "test-plugin-1" in message


def test_builtin_is_replaced_only_explicitly():
    class Shadow:
        @miles.hookimpl
        def miles_register_rewards(self, register):
            register("exact_match", my_reward)

    class Override:
        @miles.hookimpl
        def miles_register_rewards(self, register):
            register("exact_match", my_reward, override=True)

    with pytest.raises(PluginError, match="override=True"):
        make_registry(Shadow())
    registry = make_registry(Override())
    assert registry.get("reward", "exact_match").obj is my_reward


def test_unknown_name_lists_registered_and_closest():
    registry = make_registry()
    with pytest.raises(ConfigError) as err:
        registry.get("reward", "exact_mach", where="reward.name")
    assert "unknown reward 'exact_mach' (at reward.name)" in str(err.value)
    assert "Registered rewards: code_tests, env, exact_match, f1, format, math, multiple_choice;" in str(err.value)
    assert "did you mean 'exact_match'?" in str(err.value)


def test_import_path_accepted_wherever_a_name_is():
    registry = make_registry()
    reward = registry.build("reward", {"name": "tests.test_registry:my_reward", "bonus": 2.0}, "reward")
    assert reward(make_sample()) == 3.0
    with pytest.raises(ConfigError, match="cannot import reward 'tests.nope:fn'"):
        registry.get("reward", "tests.nope:fn", where="reward.name")


def test_an_import_path_finds_the_working_directory_s_modules_and_python_files(tmp_path, monkeypatch, miles_cli):
    """``my_rew_cwd:score`` finds ./my_rew_cwd.py (as `python -m` would); ``path/to/file.py:name`` loads that file;
    what is found nowhere says where it was looked for; a module that imports something missing says that."""
    import sys

    from miles.registry import import_object

    (tmp_path / "my_rew_cwd.py").write_text("def score(sample):\n    return 0.5\n")
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "shaped.py").write_text("class Shaped:\n    def half(sample):\n        return 0.25\n")
    (tmp_path / "broken_rew_cwd.py").write_text("import not_a_package_anywhere\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the working directory it adds goes with the test
    assert import_object("my_rew_cwd:score")(None) == 0.5
    assert import_object("./rewards/shaped.py:Shaped.half")(None) == 0.25
    assert import_object(f"{tmp_path}/rewards/shaped.py:Shaped") is import_object("rewards/shaped.py:Shaped")
    with pytest.raises(ValueError, match=rf"no module named 'nowhere_rew' among the installed packages nor in the "
                                         rf"working directory {tmp_path}"):
        import_object("nowhere_rew:score")
    with pytest.raises(ValueError, match=r"No module named 'not_a_package_anywhere'"):
        import_object("broken_rew_cwd:score")
    with pytest.raises(ValueError, match=rf"{tmp_path}/gone.py: no such file \(a relative path is taken from the "
                                         rf"working directory\)"):
        import_object("gone.py:score")
    # as a user runs it: `miles config` from the folder that holds the reward, the config named by its path
    config = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
    result = miles_cli("config", config, "reward.name=my_rew_cwd:score", f"run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0 and "name: my_rew_cwd:score" in result.stdout, result.stderr[-2000:]
    result = miles_cli("config", config, "reward.name=nowhere_rew:score", cwd=tmp_path)
    assert result.returncode == 2 and "nor in the working directory" in result.stderr, result.stderr[-2000:]


def test_arguments_checked_against_signature_all_at_once():
    registry = make_registry(RewardPlugin())
    problems = registry.check("reward", {"name": "my_reward", "bonsu": 1, "extra": 2}, "reward")
    assert len(problems) == 2
    assert "reward.bonsu: reward 'my_reward' takes no argument 'bonsu'" in problems[0]
    assert "did you mean 'bonus'?" in problems[0]
    assert registry.check("reward", {"name": "my_reward", "bonus": "high"}, "reward") == [
        "reward.bonus: reward 'my_reward' expects a number, got 'high'"
    ]
    assert registry.check("backend", {"name": "torch", "lr": 1e-3}, "backend") == []


def test_required_factory_argument_reported():
    class Needs:
        def __init__(self, endpoint: str):
            self.endpoint = endpoint

    class P:
        @miles.hookimpl
        def miles_register_backends(self, register):
            register("remote", Needs)

    registry = make_registry(P())
    assert registry.check("backend", {"name": "remote"}, "backend") == [
        "backend.endpoint: backend 'remote' requires argument 'endpoint'"
    ]


def test_bad_registrations_rejected():
    class NotCallable:
        @miles.hookimpl
        def miles_register_rewards(self, register):
            register("bad", 42)

    class BadName:
        @miles.hookimpl
        def miles_register_losses(self, register):
            register("has space", my_reward)

    with pytest.raises(PluginError, match="registered reward 'bad' as a int"):
        make_registry(NotCallable())
    with pytest.raises(PluginError, match="named 'has space'"):
        make_registry(BadName())


def test_unknown_hook_is_rejected():
    class Typo:
        @miles.hookimpl
        def miles_register_reward(self, register):  # missing "s"
            pass

    with pytest.raises(PluginError, match="miles_register_reward"):
        make_registry(Typo())


def test_every_kind_has_a_registration_hook():
    pm = build_plugin_manager(autoload=False)
    for kind in KINDS.values():
        assert hasattr(pm.hook, kind.hook), kind.hook
