"""Labels and the rewards that score against them: every builtin reward says whether it needs a label and of
which types (``label_types``, miles.hookspecs.NeedsLabel), a plugin's reward can say the same, a run whose data
lacks labels or holds labels of another type is refused at start (exit code 2, naming the file, the label key,
the reward and the lines), and a sample without a label fails instead of being scored against nothing."""

import json

import pytest

import miles
from miles.cli import main
from miles.hookspecs import NeedsLabel
from miles.interrupts import with_time_limit
from miles.rewards.labels import LabelNeed, declared_label_types, label_need, label_problem
from miles.rewards.scoring import score_samples
from miles.rollout.data_source import Prompt, check_labels
from miles.testing import make_registry, make_sample
from miles.types import SampleStatus

CONFIG = "configs/quickstart.yaml"
QUICK = ["run.progress=false", "sft.steps=0", "run.steps=2", "run.eval_size=0", "rollout.prompts_per_step=2",
         "rollout.n_samples=2", "data.generator=null"]

# What each builtin reward compares; a new builtin must be added here (the test below lists every registered one).
BUILTIN_LABELS = {"exact_match": (str, int, float), "math": (str, int, float), "multiple_choice": (str,),
                  "f1": (str, int, float, list), "code_tests": (str, list)}
NO_LABEL = {"env", "format"}  # the environment's reward; format's needs are its inner reward's

# One label of each kind a JSONL file can hold, and which builtins compare it.
LABELS = {
    "string": ("7", {"exact_match", "math", "multiple_choice", "f1", "code_tests"}),
    "integer": (7, {"exact_match", "math", "f1"}),
    "float": (7.5, {"exact_match", "math", "f1"}),
    "boolean": (True, set()),
    "object": ({"answer": "7"}, set()),
    "list of strings": (["7", "seven"], {"f1", "code_tests"}),
    "list with a number": (["7", 7], {"f1"}),
    "list with null": (["7", None], set()),
    "nested list": ([["7"]], set()),
}
EMPTY = {"null": None, "empty string": "", "blank string": "  \n", "empty list": []}


class LabelledPlugin:
    """A plugin's rewards: ``strict`` declares it compares strings only; ``free`` reads no label."""

    def __init__(self):
        self.calls = []

    @miles.hookimpl
    def miles_register_rewards(self, register):
        calls = self.calls

        def strict(sample):
            calls.append(sample.label)
            return float(sample.response_text == sample.label)

        strict.label_types = (str,)

        def free(sample):
            calls.append(sample.label)
            return float(len(sample.response_text) > 0)

        register("strict", strict)
        register("free", free)


@pytest.fixture(scope="module")
def registry():
    return make_registry()


def test_every_builtin_reward_declares_what_it_needs_of_the_label(registry):
    assert set(registry.names("reward")) == set(BUILTIN_LABELS) | NO_LABEL
    for name in registry.names("reward"):
        obj = registry.get("reward", name).obj
        assert declared_label_types(obj) == BUILTIN_LABELS.get(name), name
        assert isinstance(obj, NeedsLabel) == (name in BUILTIN_LABELS), name


@pytest.mark.parametrize("kind", LABELS)
@pytest.mark.parametrize("reward", sorted(BUILTIN_LABELS))
def test_each_builtin_accepts_exactly_the_label_types_it_compares(reward, kind):
    label, accepted_by = LABELS[kind]
    problem = label_problem(label, BUILTIN_LABELS[reward])
    assert (problem is None) == (reward in accepted_by), (reward, kind, problem)


@pytest.mark.parametrize("kind", EMPTY)
@pytest.mark.parametrize("reward", sorted(BUILTIN_LABELS))
def test_no_builtin_scores_an_empty_answer_against_a_missing_label(registry, reward, kind):
    """The bug this guards against: exact_match read a missing label as "", so an empty response scored 1.0."""
    node = {"name": reward, **({"compare_timeout_s": 1.0} if reward == "math" else {})}
    built = registry.build("reward", node, "reward")
    sample = make_sample("", EMPTY[kind])
    score_samples([sample], with_time_limit(built, 60.0))
    assert sample.status is SampleStatus.FAILED and sample.reward is None
    assert sample.reason.startswith("reward: the sample has no label (data.label_key")
    with pytest.raises(ValueError, match="has no label"):  # the reward's own guard, called outside the stage
        call = built(make_sample("", EMPTY[kind]))
        if hasattr(call, "__await__"):
            import asyncio

            asyncio.run(call)


def test_format_fails_a_sample_without_a_label_through_its_inner_reward(registry):
    node = {"name": "format", "pattern": ".*", "reward": {"name": "exact_match"}}
    sample = make_sample("", None)
    score_samples([sample], registry.build("reward", node, "reward"))
    assert sample.status is SampleStatus.FAILED and "has no label" in sample.reason


def test_a_sample_without_a_label_is_never_handed_to_a_reward_that_declares_one():
    plugin = LabelledPlugin()
    reward = make_registry(plugin).build("reward", {"name": "strict"}, "reward")
    samples = [make_sample("a", "a"), make_sample("", None), make_sample("x", {"text": "x"})]
    score_samples(samples, reward)
    assert plugin.calls == ["a"]
    assert samples[0].reward == 1.0
    assert samples[1].reason == ("reward: the sample has no label (data.label_key), which reward 'strict' scores the "
                                 "response against")
    assert samples[2].reason == ("reward: reward 'strict' cannot score against the sample's label: it is an object "
                                 '({"text": "x"}); expected a string')


def test_what_a_reward_node_needs_includes_its_nested_rewards(registry):
    assert label_need(registry, {"name": "exact_match"}) == LabelNeed("exact_match", (str, int, float))
    assert label_need(registry, {"name": "env"}) is None
    assert label_need(registry, {"name": "format", "pattern": "x"}) is None
    around = {"name": "format", "pattern": "x", "reward": {"name": "multiple_choice"}}
    assert label_need(registry, around) == LabelNeed("format > multiple_choice", (str,))
    assert label_need(registry, {**around, "reward": "f1"}) == LabelNeed("format > f1", (str, int, float, list))
    plugin = make_registry(LabelledPlugin())
    assert label_need(plugin, {"name": "strict"}) == LabelNeed("strict", (str,))
    assert label_need(plugin, {"name": "free"}) is None
    assert label_need(plugin, {"name": "tests.test_labels:strict_by_path"}) == LabelNeed(
        "tests.test_labels:strict_by_path", (str, list))


def strict_by_path(sample):
    """A reward named by its import path declares its labels the same way."""
    return 0.0


strict_by_path.label_types = (str, list)


def prompts(*labels, lines=None):
    lines = lines or [i + 1 for i in range(len(labels))]
    return [Prompt(i, "1+1=", label, [1], {"answer": "2"}, line) for i, (label, line) in enumerate(zip(labels, lines))]


def test_check_labels_names_the_file_the_key_the_reward_and_the_lines():
    need = LabelNeed("exact_match", (str, int, float))
    with pytest.raises(Exception, match=r"^data file 't.jsonl': no row has a 'label' \(data.label_key\), the "
                                        r"reference answer that reward 'exact_match' needs; its other columns are: "
                                        r"answer\. Set data.label_key to the column that holds them, or use a reward "
                                        r"that needs none$"):
        check_labels(prompts(None, None), "t.jsonl", "label", need)
    with pytest.raises(Exception, match=r"^data file 't.jsonl': lines 3, 9 \(2 of 4 rows\) have no 'label' "
                                        r"\(data.label_key; missing, null or empty\), which reward 'exact_match' "
                                        r"needs\. Add the labels, or remove those rows$"):
        check_labels(prompts("2", None, "4", "", lines=[1, 3, 4, 9]), "t.jsonl", "label", need)
    with pytest.raises(Exception, match=r"^data file 't.parquet': row 2 \(1 of 2 rows\) has no 'label'"):
        check_labels(prompts("2", []), "t.parquet", "label", need)
    with pytest.raises(Exception, match=r"^data file 't.jsonl', line 5: reward 'exact_match' cannot use its "
                                        r"'label': it is an object \(\{\"x\": 1\}\); expected a string or a number "
                                        r"\(lines 6, 8 too\)$"):
        check_labels(prompts("2", {"x": 1}, [1], True, lines=[1, 5, 6, 8]), "t.jsonl", "label", need)
    with pytest.raises(Exception, match=r"^data file 't.jsonl': line 3 \(1 of 4 rows\) has no 'label' "
                                        r"\(data.label_key; missing, null or empty\), which reward 'exact_match' "
                                        r"needs; and line 5: reward 'exact_match' cannot use its 'label': it is an "
                                        r"object \(\{\"x\": 1\}\); expected a string or a number \(line 8 too\)\. "
                                        r"Add or correct the labels, or remove those rows$"):
        check_labels(prompts("2", {"x": 1}, None, [1], lines=[1, 5, 3, 8]), "t.jsonl", "label", need)
    check_labels(prompts("2", 3, 4.5), "t.jsonl", "label", need)  # strings and numbers mixed: all comparable
    many = prompts(*([None] * 25 + ["1"]))
    with pytest.raises(Exception, match=r"lines 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, \.\.\. \(25 in all\) \(25 of 26 rows\)"):
        check_labels(many, "t.jsonl", "label", need)


def write_jsonl(path, rows):
    path.write_text("".join((json.dumps(row) if row is not None else "") + "\n" for row in rows))
    return path


def config_check(capsys, tmp_path, path, *overrides):
    code = main(["config", "--check", CONFIG, *QUICK, f"run.dir={tmp_path / 'run'}", f"data.train_path={path}",
                 *overrides])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("rows", "expected"), [
    ([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}],
     "no row has a 'label' (data.label_key), the reference answer that reward 'exact_match' needs; its other columns "
     "are: answer"),
    ([{"prompt": "1+1=", "label": "2"}, None, {"prompt": "2+2="}, {"prompt": "3+3=", "label": None}],
     "lines 3, 4 (2 of 3 rows) have no 'label' (data.label_key; missing, null or empty), which reward 'exact_match' "
     "needs"),
    ([{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": {"value": 4}}],
     "line 2: reward 'exact_match' cannot use its 'label': it is an object ({\"value\": 4})"),
    # both kinds in one file: one run names every row to fix
    ([{"prompt": "1+1=", "label": [3]}, {"prompt": "2+2="}, {"prompt": "3+3=", "label": True},
      {"prompt": "4+4=", "label": ""}],
     "lines 2, 4 (2 of 4 rows) have no 'label' (data.label_key; missing, null or empty), which reward 'exact_match' "
     "needs; and line 1: reward 'exact_match' cannot use its 'label': it is a list ([3]); expected a string or a "
     "number (line 3 too). Add or correct the labels, or remove those rows"),
])
def test_data_a_reward_cannot_score_is_refused_at_start(capsys, tmp_path, rows, expected):
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    code, err = config_check(capsys, tmp_path, path)
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("miles: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"miles: error: data file '{path}'") and expected in errors[0]
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_labels_are_checked_for_the_reward_configured_and_every_file_it_scores(capsys, tmp_path):
    no_labels = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}+1="} for i in range(4)])
    code, err = config_check(capsys, tmp_path, no_labels, "reward={name: format, pattern: '[0-9]'}")
    assert code == 0, err  # a reward that reads no label needs none
    code, err = config_check(capsys, tmp_path, no_labels, "reward={name: format, pattern: x, reward: math}")
    assert code == 2 and "the reference answer that reward 'format > math' needs" in err
    code, err = config_check(capsys, tmp_path, no_labels, "run.steps=0", "sft.steps=0")
    assert code == 0, err  # nothing is scored
    some = write_jsonl(tmp_path / "some.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": None}])
    code, err = config_check(capsys, tmp_path, some, "run.steps=0", "sft.steps=2", "reward.name=env")
    expected = "line 2 (1 of 2 rows) has no 'label' (data.label_key; missing, null or empty), which the SFT warm-up"
    assert code == 2 and f"{expected} (sft.steps > 0) needs" in err  # it would train on the text "None"
    train = write_jsonl(tmp_path / "good.jsonl", [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(4)])
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": ""}])
    code, err = config_check(capsys, tmp_path, train, f"data.eval_path={held_out}", "run.eval_size=2")
    assert code == 2 and f"data file '{held_out}': line 2 (1 of 2 rows) has no 'label'" in err
    code, err = config_check(capsys, tmp_path, train, "eval.datasets=[{name: extra, path: " + str(held_out) + "}]")
    assert code == 2 and f"data file '{held_out}': line 2 (1 of 2 rows) has no 'label'" in err


def test_a_plugin_reward_declares_its_label_types_and_gets_the_same_checks(capsys, tmp_path):
    plugin = LabelledPlugin()
    numbers = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": 4}])
    from miles.config.prepared import prepare
    from miles.errors import DataError
    from miles.run.preflight import preflight

    p = prepare(CONFIG, [*QUICK, f"run.dir={tmp_path / 'run'}", f"data.train_path={numbers}", "reward.name=strict"],
                extra_plugins=[("labelled", plugin)])
    with pytest.raises(DataError, match=r"line 2: reward 'strict' cannot use its 'label': it is an integer "
                                        r"\(4\); expected a string$"):
        preflight(p, [])
    p = prepare(CONFIG, [*QUICK, f"run.dir={tmp_path / 'run'}", f"data.train_path={numbers}", "reward.name=free"],
                extra_plugins=[("labelled", plugin)])
    preflight(p, []).discard()


def test_miles_train_refuses_prompts_without_labels_before_anything_is_written(capsys, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2="}])
    code = main(["train", CONFIG, *QUICK, f"run.dir={tmp_path / 'run'}", f"data.train_path={path}"])
    err = capsys.readouterr().err
    assert code == 2 and f"miles: error: data file '{path}': no row has a 'label'" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_miles_eval_checks_the_labels_of_what_it_scores(capsys, tmp_path, tiny_model_dir):
    path = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2="}])
    code = main(["eval", CONFIG, "--model", str(tiny_model_dir), "run.progress=false", "data.generator=null",
                 f"data.train_path={path}", f"data.eval_path={path}"])
    err = capsys.readouterr().err
    assert code == 2 and f"miles: error: data file '{path}': line 2 (1 of 2 rows) has no 'label'" in err
