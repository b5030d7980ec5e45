"""The examples of docs/agentic.md register and train."""

import json
import types
from pathlib import Path

from miles.run.runner import prepare, train
from miles.testing import CHAT_TOKENIZER, make_registry

from test_docs import python_blocks

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _examples() -> types.ModuleType:
    module = types.ModuleType("agentic_docs")
    blocks = [b for b in python_blocks(DOCS / "agentic.md") if "SandboxConformance" not in b]
    exec(compile("\n\n".join(blocks), "docs/agentic.md", "exec"), module.__dict__)
    return module


TestTheDocsGuessNumber = _examples().TestGuessNumber  # the docs' EnvConformance example, run by pytest


def test_the_custom_env_fits_in_40_lines_and_registers():
    block = next(b for b in python_blocks(DOCS / "agentic.md") if "class GuessNumber" in b)
    assert len(block.strip().splitlines()) <= 40
    registry = make_registry(_examples())
    assert registry.get("env", "guess_number").plugin.name.startswith("test-plugin")
    assert registry.get("tool", "add").obj.schema["function"]["parameters"]["required"] == ["a", "b"]
    parser = registry.build("tool_parser", {"name": "call_lines"}, "rollout.tool_parser")
    good, bad = parser.parse('Adding.\nCALL add {"a": 1, "b": 2}\nCALL add {oops}')
    assert (good.name, good.arguments, good.error) == ("add", {"a": 1, "b": 2}, None) and "not valid JSON" in bad.error
    assert parser.content('Adding.\nCALL add {"a": 1}') == "Adding."


def test_the_custom_env_trains_with_its_own_reward(tmp_path):
    tokenizer = ", ".join(f"{k}: {json.dumps(v)}" for k, v in CHAT_TOKENIZER.items())
    train(prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path}", "run.steps=3", "sft.steps=0", "run.eval_size=0", "run.progress=false",
        "rollout.prompts_per_step=4", "rollout.n_samples=4", "rollout.sampling.max_new_tokens=3",
        "rollout.fn={name: multi_turn, max_turns: 3}", "rollout.env={name: guess_number}", "reward={name: env}",
        "model.build.max_position_embeddings=128",
        # YAML's escape: a line break itself would be folded into a space (and is refused in an override)
        "model.tokenizer={kind: char, alphabet: \"0123456789+=abcdefghijklmnopqrstuvwxyz .\\n\", " + tokenizer + "}",
    ], extra_plugins=[("docs", _examples())]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["samples/failed"] == 0 and r["turns/max"] <= 3 for r in rows)
    assert any(r["rollout/observation_token_frac"] > 0 for r in rows)  # hints came back as observations
