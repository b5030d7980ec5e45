import pytest
from omegaconf import OmegaConf

from miles.cli import main
from miles.config import load_config, validate_config
from miles.errors import ConfigError
from miles.testing import make_registry

QUICKSTART = "configs/quickstart.yaml"


def test_defaults_file_and_overrides_merge():
    config = load_config(QUICKSTART, ["run.steps=7", "reward.name=exact_match", "backend.lr=0.01"])
    assert config.run.steps == 7
    assert config.backend == {"name": "torch", "lr": 0.01, "max_grad_norm": 1.0, "micro_batch_size": 128}
    assert config.rollout.n_samples == 8  # from the file
    assert config.rollout.sampling.top_p == 1.0  # from the structured defaults
    assert config.data.generator.name == "addition"


def test_renaming_a_component_on_the_command_line_drops_the_old_arguments_and_says_which(capsys):
    config = load_config(QUICKSTART, ["backend.name=my_backend"])
    assert config.backend == {"name": "my_backend"}  # lr, max_grad_norm ... belonged to torch
    assert capsys.readouterr().err.strip() == (
        f"backend.name=my_backend replaces 'torch': its arguments from {QUICKSTART} are dropped (backend.lr, "
        f"backend.max_grad_norm, backend.micro_batch_size); give those that apply to 'my_backend' again as overrides "
        f"(backend.lr=...)")
    config = load_config(QUICKSTART, ["backend.name=my_backend", "backend.lr=0.1"])
    assert config.backend == {"name": "my_backend", "lr": 0.1}
    assert "(backend.max_grad_norm, backend.micro_batch_size)" in capsys.readouterr().err  # lr: given again
    config = load_config(QUICKSTART, ["backend.name=torch", "backend.lr=0.3"])  # same name: arguments kept
    assert config.backend == {"name": "torch", "lr": 0.3, "max_grad_norm": 1.0, "micro_batch_size": 128}
    assert capsys.readouterr().err == ""


def test_miles_config_and_train_say_what_a_renamed_component_dropped(tmp_path, capsys):
    from miles.cli import main

    assert main(["config", QUICKSTART, "reward.name=f1"]) == 0
    assert "reward.name=f1 replaces" not in capsys.readouterr().err  # the file gave exact_match no arguments
    assert main(["config", QUICKSTART, "backend.name=my_backend"]) == 2  # no such backend: refused, after saying it
    assert "dropped (backend.lr, backend.max_grad_norm, backend.micro_batch_size)" in capsys.readouterr().err
    assert main(["train", QUICKSTART, "backend.name=my_backend", f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "backend.name=my_backend replaces 'torch': its arguments from" in err, err
    assert not (tmp_path / "run").exists()


def test_unknown_key_and_wrong_type_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, ["rollout.n_sample=4", "run.steps=many", "model.build.hiden_size=32"])
    message = str(err.value)
    assert message.startswith("Config is not well-formed")
    assert "unknown config key 'rollout.n_sample'" in message and "did you mean 'rollout.n_samples'?" in message
    assert "config key 'run.steps' (in overrides) expects int, got 'many'" in message
    assert "did you mean 'model.build.hidden_size'?" in message


def test_errors_in_the_file_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  steps: [1, 2]\nrollout:\n  prompts_per_stp: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"(in {path})" in str(err.value)
    assert "'run.steps'" in str(err.value) and "'rollout.prompts_per_stp'" in str(err.value)


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(QUICKSTART, ["run.steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_component_arguments_checked_before_anything_runs():
    registry = make_registry()
    config = load_config(QUICKSTART, ["loss.clip_lw=0.1", "advantage.normalize_std=maybe", "selection=[{name: nope}]",
                                      "rollout.sampling.temperature=-1"])
    with pytest.raises(ConfigError) as err:
        validate_config(config, registry)
    message = str(err.value)
    assert "loss.clip_lw: loss 'ppo_clip' takes no argument 'clip_lw'" in message
    assert "did you mean 'clip_low'?" in message
    assert "advantage.normalize_std: advantage 'grpo' expects true or false, got 'maybe'" in message
    assert "unknown data_selector 'nope' (at selection[0].name)" in message
    assert "rollout.sampling.temperature: expected a number >= 0" in message


def test_quickstart_config_is_valid():
    validate_config(load_config(QUICKSTART), make_registry())


def test_miles_config_prints_resolved_config(capsys, tmp_path):
    assert main(["config", QUICKSTART, "run.steps=3", "reward.name=exact_match", f"run.dir={tmp_path / 'run'}"]) == 0
    printed = OmegaConf.create(capsys.readouterr().out)
    assert printed.run.steps == 3
    assert printed.rollout.sampling.max_new_tokens == 4
    assert printed.loss.name == "ppo_clip"


def test_miles_config_reports_errors_with_exit_2(capsys):
    assert main(["config", QUICKSTART, "reward.name=nope"]) == 2
    err = capsys.readouterr().err
    assert "miles: error:" in err and "unknown reward 'nope'" in err


def test_miles_config_shows_only_the_model_keys_that_apply(tmp_path, capsys, tiny_model_dir):
    """A run on ``model.path`` uses that model's architecture and tokenizer: ``model.build`` and
    ``model.tokenizer`` (a built model's) are left out of what ``miles config`` prints, and it says so."""
    import yaml

    from miles.cli import main

    assert main(["config", QUICKSTART, f"run.dir={tmp_path / 'run'}"]) == 0
    assert {"build", "tokenizer"} <= set(yaml.safe_load(capsys.readouterr().out)["model"])
    assert main(["config", QUICKSTART, f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# model.build and model.tokenizer are a built model's: not shown, model.path is set")
    model = yaml.safe_load(out)["model"]
    assert model["path"] == str(tiny_model_dir) and not {"build", "tokenizer"} & set(model)
