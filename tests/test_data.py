import json

import pandas  # noqa: F401  (datasets depends on it; Parquet files are written with it here)
import pytest

from miles.errors import DataError
from miles.models.hf import build_char_tokenizer
from miles.rollout.data_source import PromptSource, read_rows

ROWS = [{"question": "1+2=", "answer": "3"}, {"question": "4+4=", "answer": "8"}, {"question": "0+5=", "answer": "5"}]


@pytest.fixture
def tokenizer():
    return build_char_tokenizer("0123456789+=")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_with_configured_keys(tmp_path, tokenizer):
    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    parquet = tmp_path / "d.parquet"
    pandas.DataFrame(ROWS).to_parquet(parquet)
    for path in (jsonl, parquet):
        rows = read_rows(path, "question", "answer")
        assert rows == ROWS
    source = PromptSource(rows, tokenizer, prompt_key="question", label_key="answer", chat_template="auto",
                          shuffle=False, seed=0)
    first = source.next(1)[0]
    assert (first.prompt, first.label) == ("1+2=", "3")
    assert tokenizer.decode(first.prompt_ids) == "1+2="


def test_shuffled_order_covers_each_epoch_and_is_seeded(tmp_path, tokenizer):
    rows = [{"prompt": f"{i}+0=", "label": str(i)} for i in range(10)]
    make = lambda seed: PromptSource(rows, tokenizer, prompt_key="prompt", label_key="label",  # noqa: E731
                                     chat_template="false", shuffle=True, seed=seed)
    a, b = make(3), make(3)
    first_epoch = [p.index for p in a.next(10)]
    assert sorted(first_epoch) == list(range(10))
    assert [p.index for p in b.next(10)] == first_epoch
    assert a.position == 10 and len(a.next(15)) == 15


def test_chat_template_applied_when_the_tokenizer_has_one(tokenizer):
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}={% endfor %}"
                               "{% if add_generation_prompt %}+{% endif %}")
    rows = [{"prompt": "12", "label": "3"}]
    with_template = PromptSource(rows, tokenizer, prompt_key="prompt", label_key="label", chat_template="auto",
                                 shuffle=False, seed=0)
    assert tokenizer.decode(with_template.prompts[0].prompt_ids) == "12=+"
    plain = PromptSource(rows, tokenizer, prompt_key="prompt", label_key="label", chat_template="false",
                         shuffle=False, seed=0)
    assert tokenizer.decode(plain.prompts[0].prompt_ids) == "12"


def test_missing_file_and_missing_key_are_named(tmp_path):
    with pytest.raises(DataError, match="'.*nope.jsonl' does not exist"):
        read_rows(tmp_path / "nope.jsonl", "prompt", None)
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError) as err:
        read_rows(path, "prompt", None)
    assert "rows have no 'prompt' column (data.prompt_key)" in str(err.value)
    assert "its columns are: question, answer" in str(err.value)
    with pytest.raises(DataError, match="unsupported extension '.csv'"):
        read_rows(tmp_path.joinpath("x.csv").touch() or tmp_path / "x.csv", "prompt", None)


def test_tool_arithmetic_writes_tool_traces_and_some_direct_answers():
    from miles.builtin.data import tool_arithmetic

    splits = tool_arithmetic(seed=0, size=400, direct_fraction=0.5)
    rows = splits["train"] + splits["eval"]
    assert len(rows) == 400 and not {r["prompt"] for r in splits["train"]} & {r["prompt"] for r in splits["eval"]}
    for row in rows:
        a, b = row["prompt"].rstrip("=").split("*")
        assert (row["label"] == str(int(a) * int(b))
                and row["messages"][-1] == {"role": "assistant", "content": row["label"]})
    with_tool = [r for r in rows if len(r["messages"]) == 3]
    assert 150 < len(with_tool) < 250
    assert with_tool[0]["messages"][:2] == [
        {"role": "assistant", "content": f"```python\nprint({with_tool[0]['prompt'][:-1]})\n```"},
        {"role": "tool", "content": with_tool[0]["label"] + "\n"}]
