"""Each config key's type, range and meaning are declared once, next to its field: the start-up checks and
the reference table of docs/config.md are both made from that declaration."""

import ast
from pathlib import Path

import pytest

from miles.config import load_config, validate_config
from miles.config.keys import keys
from miles.config.reference import render, update
from miles.config.schema import EvalDatasetConfig, schema_keys
from miles.errors import ConfigError
from miles.testing import make_registry

ROOT = Path(__file__).resolve().parent.parent


def test_config_reference_table_is_generated_from_the_schema():
    text = (ROOT / "docs" / "config.md").read_text()
    assert update(text) == text, "run: python -m miles.config.reference"
    assert render() in text


def test_every_key_has_a_one_line_meaning_and_a_default_it_accepts():
    for entry in schema_keys():
        assert entry.doc and "\n" not in entry.doc, entry.path
        if entry.accepts is not None:
            assert entry.problem(entry.default) is None, entry.path


def _refused(entry):
    """A value the key does not accept."""
    accepts = entry.accepts
    if accepts.choices is not None:
        return "no_such_choice"
    return accepts.gt if accepts.gt is not None else accepts.ge - 1


def test_range_checks_come_from_the_declarations():
    checked = [e for e in schema_keys() if e.accepts is not None and "[i]" not in e.path]
    assert len(checked) >= 30
    overrides = [f"{e.path}={_refused(e)}" for e in checked]
    with pytest.raises(ConfigError) as err:
        validate_config(load_config("configs/quickstart.yaml", overrides), make_registry())
    for e in checked:
        assert f"\n- {e.path}: expected {e.expected}, got " in str(err.value), e.path


def test_range_checks_of_a_list_of_sections_name_the_element():
    checked = [e for e in keys(EvalDatasetConfig) if e.accepts is not None]
    dataset = {}
    for e in checked:
        *parents, leaf = e.path.split(".")
        node = dataset
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _refused(e)
    with pytest.raises(ConfigError) as err:
        validate_config(load_config("configs/quickstart.yaml", [f"eval.datasets=[{dataset}]"]), make_registry())
    for e in checked:
        assert f"\n- eval.datasets[0].{e.path}: expected {e.expected}, got " in str(err.value), e.path


@pytest.mark.parametrize(("override", "message"), [
    ("run.max_failed_frac=1.5", "run.max_failed_frac: expected a fraction between 0 and 1, got 1.5"),
    ("rollout.sampling.top_k=0", "rollout.sampling.top_k: expected -1 (off) or a whole number >= 1, got 0"),
    ("model.tokenizer.max_ranks=255", "model.tokenizer.max_ranks: expected 0 (the whole vocabulary) or at least 256"),
    ("data.chat_template=maybe", "data.chat_template: expected auto, true or false, got 'maybe'"),
    ("cluster.object_store_mb=74", "cluster.object_store_mb: expected at least 75 (Ray's minimum), got 74"),
    ("eval.datasets=[{name: a, n: 0}]", "eval.datasets[0].n: expected a whole number >= 1 (samples per prompt), got 0"),
])
def test_range_messages_keep_their_wording(override, message):
    with pytest.raises(ConfigError, match="Config is not well-formed") as err:
        validate_config(load_config("configs/quickstart.yaml", [override]), make_registry())
    assert message in str(err.value)


def test_config_modules_import_no_cycle():
    """The modules of miles.config import one another (at the top or inside a function) without a cycle."""
    package = ROOT / "miles" / "config"
    graph = {}
    for path in package.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("miles.config."):
                names.add(node.module.removeprefix("miles.config."))
            elif isinstance(node, ast.Import):
                names |= {a.name.removeprefix("miles.config.") for a in node.names
                          if a.name.startswith("miles.config.")}
        graph[path.stem] = names

    def visit(name, stack):
        assert name not in stack, f"import cycle: {' -> '.join([*stack, name])}"
        for other in graph.get(name, ()):
            visit(other, [*stack, name])

    for name in graph:
        if name != "__init__":
            visit(name, [])
