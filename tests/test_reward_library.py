"""The builtin reward library (math, multiple_choice, f1, format, code_tests) on hand-made cases, built
through the registry and scored by the reward stage as a run does."""

import inspect
import time

import pytest

import miles
from miles.cli import main
from miles.errors import ConfigError
from miles.rewards import extract_answer, extract_choice
from miles.rewards.code_tests import last_python_block, split_tests
from miles.rewards.token_f1 import normalize_answer
from miles.interrupts import with_time_limit
from miles.rewards.scoring import score_samples
from miles.testing import make_registry, make_sample
from miles.types import SampleStatus


class HelperRewards:
    @miles.hookimpl
    def miles_register_rewards(self, register):
        register("length_bonus", length_bonus)
        register("slow_judge", slow_judge)
        register("per_step", per_step)


def length_bonus(sample, per_char: float = 0.0):
    return {"score": 0.5 + per_char * len(sample.response_text), "chars": float(len(sample.response_text))}


async def slow_judge(sample):
    return 0.25


@miles.batched
def per_step(samples):
    return [1.0] * len(samples)


@pytest.fixture(scope="module")
def registry():
    return make_registry(HelperRewards())


def scored(registry, node, *cases):
    """The samples of ``(response, label)`` cases after the reward stage scored them with ``node``, under
    the default time limit (so that plain rewards run in a worker thread, as in a run)."""
    reward = with_time_limit(registry.build("reward", node, "reward"), 60.0)
    samples = [make_sample(response, label) for response, label in cases]
    score_samples(samples, reward)
    return samples


def test_builtin_library_is_registered_by_the_builtin_plugin():
    registry = make_registry()
    for name in ("math", "multiple_choice", "f1", "format", "code_tests"):
        entry = registry.get("reward", name)
        assert entry.builtin and entry.plugin.name == "miles.builtin.rewards"


# -- math -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("response", "answer"), [
    ("so the result is \\boxed{\\frac{1}{\\sqrt{2}}}.", "\\frac{1}{\\sqrt{2}}"),  # nested braces
    ("first \\boxed{1}, then \\boxed{2}", "2"),  # the last box
    ("the set is \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close it
    ("\\boxed{3} and a broken \\boxed{4", "3"),  # an unclosed box is no answer
    ("$\\boxed{x = 3}$", "x = 3"),
    ("Thus the answer is 42. Checking: 6 * 7 = 42 indeed, 43 is wrong.", "42"),
    ("**Answer:** $\\frac{3}{4}$", "\\frac{3}{4}"),
    ("The answer is 3, since 3 is odd", "3"),
    ("We get $x = 5$ and that is all", "x = 5"),
    ("the answer to part 2 is below: 17 apples", "17"),  # "answer to" is no answer statement: the last number
    ("In total 1,250 apples and -0.5 pears", "-0.5"),
    ("She pays $5 for a pen and $10 for a book, so $15 in all.", "15"),  # currency signs are no math span
    ("8 * 9 = 72\n#### 72", "72"),  # GSM8K's answer line
    ("half is 1/2", "1/2"),
    ("no numbers here", None),
])
def test_math_finds_the_final_answer(response, answer):
    assert extract_answer(response) == answer


def test_math_boxed_only_needs_a_box():
    assert extract_answer("The answer is 7", boxed_only=True) is None
    assert extract_answer("The answer is 7, \\boxed{8}", boxed_only=True) == "8"


def test_math_scores_equal_numbers_and_expressions(registry):
    cases = [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The answer is 0.5.", "\\frac{1}{2}", 1.0),
        ("so x = 1/2", "$0.5$", 1.0),
        ("In all 1,000 apples", "1000", 1.0),
        ("The answer is $2x+1$", "1+2x", 1.0),  # symbolic: through math-verify
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{10\\%}", "0.1", 1.0),
        ("\\boxed{x = 3}", "\\boxed{3}", 1.0),  # a boxed label is unboxed
        ("The answer is 3", "4", 0.0),
        ("\\boxed{2x+2}", "2x+1", 0.0),
        ("\\boxed{0.51}", "1/2", 0.0),
    ]
    samples = scored(registry, {"name": "math"}, *[(response, label) for response, label, _ in cases])
    assert [s.reward for s in samples] == [expected for _, _, expected in cases]
    assert samples[4].metadata["reward_info"] == {"answer": "2x+1"}


def test_math_scores_garbage_zero_and_says_why(registry):
    garbage = ["}}}{{{\\boxed{", "\\boxed{\\frac{", "\\boxed{x^{^{}}}", "$$$", "\\boxed{" + "(" * 300 + "}",
               "\x00\ufffd\\boxed{\x00}", "\\boxed{" + "9" * 2000 + "}", ""]
    samples = scored(registry, {"name": "math"}, *[(text, "3") for text in garbage])
    assert [(s.status, s.reward) for s in samples] == [(SampleStatus.COMPLETED, 0.0)] * len(garbage)
    assert samples[0].metadata["reward_info"] == {"reason": "no answer found"}
    assert samples[6].metadata["reward_info"] == {"reason": "answer longer than 1000 characters"}
    [boxed_only] = scored(registry, {"name": "math", "boxed_only": True}, ("The answer is 3", "3"))
    assert boxed_only.reward == 0.0 and boxed_only.metadata["reward_info"] == {"reason": "no \\boxed{} answer"}


def test_math_comparison_time_is_bounded_in_a_worker_thread(registry):
    """2^(10^10) makes sympy compute for a long time: the comparison process is killed at the limit, the
    sample scores 0 with the reason, and the next comparison gets a new process."""
    start = time.monotonic()
    slow, after = scored(registry, {"name": "math", "compare_timeout_s": 0.5},
                         ("\\boxed{2^{10^{10}}}", "3"), ("\\boxed{2x+1}", "1+2x"))
    assert time.monotonic() - start < 20
    assert slow.status is SampleStatus.COMPLETED and slow.reward == 0.0
    assert slow.metadata["reward_info"]["reason"] == "comparison timed out after 0.5 s"
    assert after.reward == 1.0


def test_math_without_a_label_fails_the_sample(registry):
    [sample] = scored(registry, {"name": "math"}, ("\\boxed{1}", None))
    assert sample.status is SampleStatus.FAILED and "has no label" in sample.reason


# -- multiple_choice ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("response", "choice"), [
    ("Answer: B", "B"),
    ("so the answer is b", "B"),
    ("The answer is (C).", "C"),
    ("The correct option is D because ...", "D"),
    ("The answer is option E", "E"),
    ("Final: \\boxed{A}", "A"),
    ("I pick (B)", "B"),
    ("B. Paris is the capital", "B"),
    ("After all that, **D**", "D"),
    ("Thinking...\nC\n", "C"),
    ("(A) looks right... no wait, (C)", "C"),  # the last occurrence wins
    ("Answer: A\nOn reflection, the final answer: C", "C"),
    ("The answer is B. (A) and C) are wrong.", "B"),  # a stated answer beats later bare letters
    ("the answer is a bit unclear", None),  # lower-case "a" is a word here
    ("A cat sat on the mat", None),
    ("E.g. this one", None),
    ("Answer: F", None),  # not a choice
])
def test_multiple_choice_finds_the_chosen_letter(response, choice):
    assert extract_choice(response) == choice


def test_multiple_choice_scores_against_the_label(registry):
    samples = scored(registry, {"name": "multiple_choice"},
                     ("Answer: B", "(b)"), ("Answer: B", "C"), ("no idea", "A"), ("Answer: B", "Z"), ("B", None))
    assert [s.reward for s in samples[:3]] == [1.0, 0.0, 0.0]
    assert samples[2].metadata["reward_info"] == {"reason": "no choice found"}
    assert samples[3].status is SampleStatus.FAILED and "not one of the choices ABCDE" in samples[3].reason
    assert samples[4].status is SampleStatus.FAILED
    [four] = scored(registry, {"name": "multiple_choice", "choices": "ABCD"}, ("Answer: E", "A"))
    assert four.reward == 0.0 and four.metadata["reward_info"] == {"reason": "no choice found"}


@pytest.mark.parametrize("choices", ["A", "AAB", "AB1", ""])
def test_multiple_choice_refuses_bad_choices(registry, choices):
    with pytest.raises(ValueError, match="choices: expected two or more distinct letters"):
        registry.get("reward", "multiple_choice").obj.check_args({"choices": choices})


# -- f1 -----------------------------------------------------------------------------------------------------


def test_f1_normalises_as_squad():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("An apple, a pear.") == "apple pear"


def test_f1_scores_token_overlap(registry):
    samples = scored(registry, {"name": "f1"},
                     ("the Eiffel Tower.", "Eiffel Tower"),  # same tokens after normalisation
                     ("Paris, France", "Paris"),  # precision 1/2, recall 1
                     ("in Paris", ["London", "paris"]),  # the best of the labels
                     ("paris paris", "paris"),  # a repeated token counts once per occurrence in the label
                     ("London", "Paris"),
                     ("the", "a"),  # both empty after normalisation
                     ("", "Paris"),
                     ("x", []))
    assert [s.reward for s in samples[:7]] == pytest.approx([1.0, 2 / 3, 2 / 3, 2 / 3, 0.0, 1.0, 0.0])
    assert samples[7].status is SampleStatus.FAILED and "has no label" in samples[7].reason


# -- format -------------------------------------------------------------------------------------------------


def test_format_alone_scores_a_match(registry):
    think = {"name": "format", "pattern": r"<think>.*</think>\s*<answer>.*</answer>", "flags": "s"}
    samples = scored(registry, think, ("<think>a\nb</think>\n<answer>4</answer>", None), ("<answer>4</answer>", None))
    assert [s.reward for s in samples] == [{"score": 1.0, "format": 1.0}, {"score": 0.0, "format": 0.0}]
    digits = {"name": "format", "pattern": r"\d+", "full_match": True, "weight": 0.5}
    assert [s.scalar_reward for s in scored(registry, digits, ("42", None), ("x42", None))] == [0.5, 0.0]
    case = {"name": "format", "pattern": "^answer:", "flags": "im"}
    assert scored(registry, case, ("thinking\nANSWER: 4", None))[0].scalar_reward == 1.0


def test_format_gates_or_adds_to_an_inner_reward(registry):
    boxed = r"\\boxed\{"
    cases = [("\\boxed{4}", "4"), ("The answer is 4", "4"), ("\\boxed{5}", "4")]
    gate = scored(registry, {"name": "format", "pattern": boxed, "reward": {"name": "math"}}, *cases)
    assert [s.reward for s in gate] == [{"score": 1.0, "format": 1.0}, {"score": 0.0, "format": 0.0},
                                        {"score": 0.0, "format": 1.0}]
    assert "reward_info" not in gate[1].metadata  # gated off: the inner reward did not run
    add = scored(registry, {"name": "format", "pattern": boxed, "reward": "math", "mode": "add", "weight": 0.1}, *cases)
    assert [s.scalar_reward for s in add] == pytest.approx([1.1, 1.0, 0.1])


def test_format_builds_its_inner_reward_through_the_registry(registry):
    """The inner node names any registered reward (here a plugin's) with its arguments; its dict entries
    are kept, and an async inner reward makes the format reward async (run concurrently by the stage)."""
    node = {"name": "format", "pattern": "ok", "reward": {"name": "length_bonus", "per_char": 0.1}, "mode": "add"}
    [sample] = scored(registry, node, ("ok", None))
    assert sample.reward == pytest.approx({"score": 0.5 + 0.2 + 1.0, "chars": 2.0, "format": 1.0})
    judged = registry.build("reward", {"name": "format", "pattern": "ok", "reward": "slow_judge"}, "reward")
    assert inspect.iscoroutinefunction(type(judged).__call__)
    [sample] = scored(registry, {"name": "format", "pattern": "ok", "reward": "slow_judge"}, ("ok", None))
    assert sample.reward == {"score": 0.25, "format": 1.0}


def test_format_checks_its_nodes_at_config_time(registry):
    def problems(**node):
        return registry.check("reward", {"name": "format", "pattern": "x", **node}, "reward")

    assert problems(reward={"name": "f1", "bogus": 1}) == [
        "reward.reward.bogus: reward 'f1' takes no argument 'bogus'; it accepts: no arguments"]
    assert "unknown reward 'maht' (at reward.reward.name)" in problems(reward="maht")[0]
    assert problems(reward=3) == ["reward.reward: expected a reward node ({name: ..., args}) or the name of a reward, "
                                  "got 3"]
    for bad, message in (({"flags": "q"}, "flags: expected letters"),
                         ({"mode": "max"}, "mode: expected one of gate, add"),
                         ({"weight": "x"}, "weight: expected a finite number")):
        with pytest.raises(ValueError, match=message):
            registry.get("reward", "format").obj.check_args({"pattern": "x", **bad})
    with pytest.raises(ConfigError, match="a batched reward"):
        registry.build("reward", {"name": "format", "pattern": "x", "reward": "per_step"}, "reward")


def test_format_with_an_invalid_pattern_is_a_config_error(capsys, tmp_path):
    base = ["config", "configs/quickstart.yaml", f"run.dir={tmp_path}", "reward.name=format"]
    assert main([*base, "reward.pattern=("]) == 2
    err = capsys.readouterr().err
    assert "reward: reward 'format' rejected its arguments: pattern: '(' is not a valid regular expression" in err
    assert main([*base, "reward.pattern=x", "reward.reward={name: math, compare_timeout_s: -1}"]) == 2
    assert "reward.reward: reward 'math' rejected its arguments: compare_timeout_s" in capsys.readouterr().err


# -- code_tests ---------------------------------------------------------------------------------------------


def test_code_tests_finds_the_code_and_the_tests():
    assert last_python_block("```python\na = 1\n```\ntext\n```py\nb = 2\n```\n```\nc = 3\n```") == "b = 2\n"
    assert last_python_block("```\nc = 3\n```") == "c = 3\n"
    assert last_python_block("no code") is None
    assert split_tests(["assert f(1) == 2", "assert f(2) == 3"]) == ("", ["assert f(1) == 2", "assert f(2) == 3"])
    setup, tests = split_tests("import math\ndef near(a, b):\n    return abs(a - b) < 1e-9\nassert near(f(0), 0)\n"
                               "assert f(1) == math.e")
    assert tests == ["assert near(f(0), 0)", "assert f(1) == math.e"] and setup.startswith("import math\ndef near")
    assert split_tests("check(f)") == ("", ["check(f)"])  # no top-level assert: the string is one test
    for label in ("assert (", "", [], None, 3):
        with pytest.raises(ValueError):
            split_tests(label)


def test_code_tests_scores_the_share_of_tests_passed(registry):
    """One sandbox run per sample: code that prints garbage, fails, hangs, exits early or never ends gets
    a share of its tests, never an exception."""
    solution = "Here you go:\n```python\nprint('garbage ' * 1000)\ndef f(x):\n    return x + 1\n```"
    node = {"name": "code_tests", "test_timeout_s": 1.0, "run_timeout_s": 4.0, "max_concurrent": 5}
    mixed, exits, no_code, string_label, endless = scored(
        registry, node,
        (solution, ["assert f(1) == 2", "assert f(2) == 5", "while True: pass",
                    "assert f(0) == 1\nprint('x' * 10**6)"]),
        ("```python\nimport os\nos._exit(0)\n```", ["assert True"]),
        ("I would rather not.", ["assert True"]),
        (solution, "import math\nassert f(1) == 2\nassert math.pi > 4"),
        ("```python\nimport time\ntime.sleep(60)\n```", [f"assert {i}" for i in range(1, 7)]),
    )
    assert all(s.status is SampleStatus.COMPLETED for s in (mixed, exits, no_code, string_label, endless))
    assert mixed.reward == {"score": 0.5, "passed": 2.0, "total": 4.0}
    assert mixed.metadata["reward_info"] == {"failed": {"1": "AssertionError", "2": "timed out after 1 s"}}
    assert exits.reward["score"] == 0.0  # exiting with code 0 before the test ran is no pass
    assert "before the test finished" in exits.metadata["reward_info"]["failed"]["0"]
    assert no_code.reward["score"] == 0.0 and no_code.metadata["reward_info"]["reason"].startswith("no ```python")
    assert string_label.reward == {"score": 0.5, "passed": 1.0, "total": 2.0}
    assert endless.reward == {"score": 0.0, "passed": 0.0, "total": 6.0}
    assert endless.metadata["reward_info"]["reason"] == "the run timed out after 4 s"
    assert endless.metadata["reward_info"]["failed"]["5"] == "not run"


def test_code_tests_with_a_bad_label_fails_the_sample(registry):
    [sample] = scored(registry, {"name": "code_tests"}, ("```python\nx = 1\n```", "def f(:"))
    assert sample.status is SampleStatus.FAILED and "not valid Python" in sample.reason
