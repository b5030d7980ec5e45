import pytest

from miles.testing import make_registry, make_sample
from miles_reward_template import plugin
from miles_reward_template.plugin import numeric_closeness


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [("7", "7", 1.0), (" 8 ", "7", 0.8), ("12", "7", 0.0), ("seven", "7", 0.0), ("", "7", 0.0)],
)
def test_numeric_closeness(response, label, expected):
    assert numeric_closeness(make_sample(response, label)) == pytest.approx(expected)


def test_scale_argument():
    assert numeric_closeness(make_sample("9", "7"), scale=10.0) == pytest.approx(0.8)


def test_registered_by_name():
    registry = make_registry(plugin)
    reward = registry.build("reward", {"name": "numeric_closeness", "scale": 2.0}, "reward")
    assert reward(make_sample("8", "7")) == pytest.approx(0.5)
    assert registry.get("reward", "numeric_closeness").plugin.name.startswith("test-plugin")
