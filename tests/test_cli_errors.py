"""Bad input: one clear paragraph naming the culprit, exit code 2, no traceback."""

import json

import pytest

from miles.cli import main

BASE = ["train", "configs/quickstart.yaml", "run.progress=false", "sft.steps=0", "run.steps=1"]


def run_main(capsys, *args):
    code = main([*BASE, *args])
    return code, capsys.readouterr().err


@pytest.fixture
def rows_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    return path


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["reward.name=exact_mtch"], "unknown reward 'exact_mtch' (at reward.name). Registered rewards: "
                                     "code_tests, env, exact_match, f1, format, math, multiple_choice"),
        (["backend.name=fsdp3"], "unknown backend 'fsdp3' (at backend.name). Registered backends: "),
        (["rollout.n_smaples=2"], "unknown config key 'rollout.n_smaples'"),
        (["run.steps=ten"], "config key 'run.steps' (in overrides) expects int, got 'ten'"),
        (["loss.clip=0.3"], "loss.clip: loss 'ppo_clip' takes no argument 'clip'"),
        (["data.generator=null", "data.train_path=/nonexistent/train.jsonl"],
         "data file '/nonexistent/train.jsonl' does not exist"),
        (["reward.name=no_such_module:fn"], "cannot import reward 'no_such_module:fn'"),
        (["reward.timeout_s=-1"], "reward.timeout_s: expected a number of seconds > 0, or 0 for no limit, got -1"),
        (["loss.agg=sum"], "loss: loss 'ppo_clip' rejected its arguments: agg='sum' is not an aggregation"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(capsys, tmp_path, overrides, expected):
    code, err = run_main(capsys, f"run.dir={tmp_path}", *overrides)
    assert code == 2
    assert err.startswith("miles: error: ")
    assert expected in err
    assert "Traceback" not in err


def test_rows_without_prompt_key(capsys, tmp_path, rows_file):
    code, err = run_main(capsys, f"run.dir={tmp_path / 'run'}", "data.generator=null", f"data.train_path={rows_file}")
    assert code == 2
    assert "rows have no 'prompt' column (data.prompt_key); its columns are: question, answer" in err


def test_real_process_exit_code_and_no_traceback(miles_cli, tmp_path):
    result = miles_cli(*BASE, f"run.dir={tmp_path}", "reward.name=exact_mtch", "rollout.n_samples=0")
    assert result.returncode == 2
    assert "did you mean 'exact_match'?" in result.stderr
    assert "rollout.n_samples: expected a whole number >= 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["config", "train"])
def test_arguments_that_only_work_together_exit_2_naming_node_and_keys(miles_cli, tmp_path, command):
    result = miles_cli(command, "configs/quickstart.yaml", f"run.dir={tmp_path}", "sft.loss.agg=constant")
    assert result.returncode == 2
    assert "sft.loss: loss 'sft' rejected its arguments: agg=constant needs norm_tokens" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_diverged_run_stops_with_a_clear_error_naming_the_tensors(capsys, tmp_path, monkeypatch):
    """A loss that turns the weights into NaN: the weight push is refused and the run stops (exit 1), naming
    what is wrong, instead of serving NaN or ending in a traceback."""
    (tmp_path / "nan_loss.py").write_text(
        "def nan_loss(inputs):\n"
        "    return (inputs.logprobs * inputs.loss_mask).sum() * float('nan'), {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = run_main(capsys, f"run.dir={tmp_path / 'run'}", "loss.name=nan_loss:nan_loss",
                         "backend.max_grad_norm=0")
    assert code == 1, err
    assert "step 0: the engines refused the new weights (version 1); they keep serving version 0" in err
    assert "NaN or inf" in err and "model.embed_tokens.weight" in err
    assert "Traceback" not in err


def test_a_signal_swallowed_in_a_destructor_stops_the_run_at_the_next_step():
    """A SIGTERM that lands in a ``__del__`` (or a weakref callback) has its exception printed and dropped by
    Python; the handler records it and the next step's check raises it again, once."""
    import os
    import signal

    from miles import interrupts

    class Dying:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10_000):  # the Python-level handler runs in here; its exception goes nowhere
                pass

    with interrupts.handling():
        Dying()
        with pytest.raises(interrupts.Terminated):
            interrupts.check()
        interrupts.check()  # raised once only
