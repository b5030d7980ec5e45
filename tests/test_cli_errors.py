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
        (["reward.max_abs=0"], "reward.max_abs: expected the largest reward magnitude a sample may have, a number "
                               "> 0 and at most 1e+18 (the square of a larger one overflows float32 advantages), "
                               "got 0"),
        (["reward.max_abs=1e30"], "reward.max_abs: expected the largest reward magnitude a sample may have, a number "
                                  "> 0 and at most 1e+18 (the square of a larger one overflows float32 advantages), "
                                  "got 1e+30"),
        (["loss.agg=sum"], "loss: loss 'ppo_clip' rejected its arguments: agg='sum' is not an aggregation"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(capsys, tmp_path, overrides, expected):
    code, err = run_main(capsys, f"run.dir={tmp_path}", *overrides)
    assert code == 2
    notices, _, error = err.partition("miles: error: ")  # a notice may come first (a renamed component's)
    assert error and all(" replaces " in line for line in notices.splitlines())
    assert expected in error
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


def test_a_loss_that_turns_nan_stops_the_run_before_the_optimizer_step_naming_the_step(capsys, tmp_path, monkeypatch):
    """A loss that would turn the weights into NaN: the step is not taken and the run stops (exit 1), naming the
    step and what made the loss NaN, instead of training NaN weights (which the engines would refuse at the push)."""
    (tmp_path / "nan_loss.py").write_text(
        "def nan_loss(inputs):\n"
        "    return (inputs.logprobs * inputs.loss_mask).sum() * float('nan'), {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = run_main(capsys, f"run.dir={tmp_path / 'run'}", "loss.name=nan_loss:nan_loss",
                         "backend.max_grad_norm=0")
    assert code == 1, err
    assert ("miles: error: step 0: the loss of micro-batch 1 of optimizer step 1 is nan: its inputs are finite at the "
            "loss tokens: the loss function made it so; that optimizer step was not taken, so no weight holds NaN "
            "or inf") in err
    assert "Traceback" not in err


HUGE_REWARD = "def huge(sample):\n    return 1e308 if sample.response_text.strip() == str(sample.label) else -1e308\n"


def test_a_reward_near_float_s_range_fails_its_samples_naming_the_reward_and_nothing_trains(capsys, tmp_path):
    """Rewards of +-1e308 would make the advantages, the loss and the weights NaN: past reward.max_abs (1e6) each
    sample fails naming the reward and its value, and the step's failures stop the run before anything trains."""
    (tmp_path / "reward.py").write_text(HUGE_REWARD)
    code, err = run_main(capsys, f"run.dir={tmp_path / 'run'}", f"reward.name={tmp_path / 'reward.py'}:huge",
                         "run.eval_size=0")
    assert code == 1, err
    assert "step 0: 128 of 128 samples failed (100%), above run.max_failed_frac=0.5" in err
    assert (f"reward: reward '{tmp_path / 'reward.py'}:huge' returned -1e+308, beyond reward.max_abs=1e+06 (a "
            f"reward that large overflows the advantages and the loss; raise reward.max_abs if it is meant)") in err
    assert "Traceback" not in err and not (tmp_path / "run" / "metrics.jsonl").read_text().strip()


def test_nan_advantages_stop_the_run_before_training_naming_the_estimator_and_the_rewards(capsys, tmp_path):
    (tmp_path / "nan_advantage.py").write_text(
        "import torch\n"
        "def nan_advantage(batch):\n"
        "    rewards = batch.sequence_rewards()\n"
        "    return (rewards / (rewards - rewards)).unsqueeze(1) * batch.loss_mask\n")  # 0/0 and 1/0
    code, err = run_main(capsys, f"run.dir={tmp_path / 'run'}", f"advantage.name={tmp_path}/nan_advantage.py:"
                         f"nan_advantage", "run.eval_size=0")
    assert code == 1, err
    assert ("miles: error: step 0: advantage 'nan_advantage' gave NaN or infinite advantages for 128 of 128 "
            "samples, whose rewards are ") in err and "; nothing was trained" in err
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


TEMPLATES = {  # a user's chat template, and what the error says of it
    "syntax error": ("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}", "line 2: unexpected '}'"),
    "unknown filter": ("{% for m in messages %}\n{{ m['content'] | shout }}\n{% endfor %}",
                       "line 2: No filter named 'shout'."),
    "raise_exception": ("{% for m in messages %}\n{% if m['role'] == 'user' %}"
                        "{{ raise_exception('Only system messages, please') }}{% endif %}\n{% endfor %}",
                        "line 2: it raised 'Only system messages, please' (rendering a conversation of one user "
                        "message)"),
    "runtime error": ("{% for m in messages %}\n\n{{ m['content'] + 1 }}\n{% endfor %}",
                      "line 3: TypeError: can only concatenate str (not \"int\") to str (rendering a conversation "
                      "of one user message)"),
}


@pytest.mark.parametrize("key", ["model.chat_template", "model.tokenizer.chat_template"])
@pytest.mark.parametrize("problem", TEMPLATES)
def test_a_chat_template_that_fails_is_refused_at_start_naming_the_file_and_line(capsys, tmp_path, problem, key):
    text, expected = TEMPLATES[problem]
    template = tmp_path / "mine.jinja"
    template.write_text(text)
    code = main(["config", "--check", "configs/quickstart.yaml", f"run.dir={tmp_path / 'run'}", f"{key}={template}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"miles: error: {key}: chat template '{template}', {expected}" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_chat_template_that_fails_on_one_prompt_of_the_data_names_the_row_and_the_line(miles_cli, tmp_path):
    template = tmp_path / "no_system.jinja"
    template.write_text("{% for m in messages %}\n{% if m['role'] == 'system' %}\n"
                        "{{ raise_exception('no system messages') }}{% endif %}{{ m['content'] }}{% endfor %}")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n" + json.dumps(
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}], "label": "4"}))
    result = miles_cli(*BASE, f"run.dir={tmp_path / 'run'}", f"model.chat_template={template}", "data.generator=null",
                       f"data.train_path={data}", "run.eval_size=0")
    assert result.returncode == 2, result.stderr
    assert (f"miles: error: data file '{data}', line 2: the chat template cannot render this prompt: at its line 3, "
            f"it raised 'no system messages'") in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
