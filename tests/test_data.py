import json
import random

import pandas  # noqa: F401  (datasets depends on it; Parquet files are written with it here)
import pytest

from miles.errors import DataError
from miles.models.hf import build_char_tokenizer
from miles.rollout.data_source import (PromptSource, Rows, check_unknown_tokens, encode_rows, read_rows,
                                       unknown_token_id, where_in_file)

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


# -- where a row is: 1-based lines of a JSONL file, blank lines counted; missing is not empty -------------------


def test_rows_are_named_by_their_line_and_a_missing_prompt_is_not_an_empty_one(tmp_path):
    """The example of the report: the prompt key missing from the row of index 37, on line 38."""
    rows = [{"prompt": f"{i}+0=", "label": str(i)} for i in range(40)]
    rows[37] = {"label": "37"}
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as err:
        read_rows(path, "prompt", None)
    assert str(err.value) == (f"data file '{path}': line 38 has no 'prompt' (missing). Every row needs a prompt "
                              f"(data.prompt_key): text, or a list of chat messages")


@pytest.mark.parametrize("seed", range(5))
def test_the_lines_named_are_the_file_lines_of_those_rows_whatever_the_blank_lines(tmp_path, seed):
    """Seeded files mixing good rows, blank lines, rows without the prompt key and rows with an empty prompt: the
    lines reported are those of the file, each under its own word."""
    rng = random.Random(seed)
    lines, missing, empty = [], [], []
    for _ in range(rng.randint(5, 30)):
        kind = rng.choice(["good", "good", "good", "blank", "missing", "null", "text", "list"])
        if kind == "blank":
            lines.append(rng.choice(["", "   "]))
            continue
        row = {"label": "1"} if kind == "missing" else {
            "prompt": {"good": "1+0=", "null": None, "text": "", "list": []}[kind], "label": "1"}
        lines.append(json.dumps(row))
        (missing if kind == "missing" else empty if kind != "good" else []).append(len(lines))
    lines.append(json.dumps({"prompt": "2+0=", "label": "2"}))
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    if not missing and not empty:
        rows = read_rows(path, "prompt", None)
        assert rows.lines == [n for n, line in enumerate(lines, 1) if line.strip()]
        return
    with pytest.raises(DataError) as err:
        read_rows(path, "prompt", None)
    message = str(err.value)
    for numbers, word in ((missing, "(missing)"), (empty, "an empty 'prompt'")):
        if numbers:
            shown = ", ".join(map(str, numbers[:10])) + (f", ... ({len(numbers)} in all)" if len(numbers) > 10 else "")
            assert f"line{'s' if len(numbers) > 1 else ''} {shown} " in message and word in message
        else:
            assert word not in message


def test_a_parquet_file_names_rows_and_a_null_prompt_is_empty(tmp_path):
    path = tmp_path / "d.parquet"
    pandas.DataFrame([{"prompt": "1+1=", "label": "2"}, {"prompt": None, "label": "3"}]).to_parquet(path)
    with pytest.raises(DataError, match=r"'.*d.parquet': row 2 has an empty 'prompt' \(null, \"\" or \[\]\)"):
        read_rows(path, "prompt", None)


def test_jsonl_values_are_kept_as_json_reads_them(tmp_path, tokenizer):
    """datasets made "007" the number 7 in a column of mixed types, and 7 the float 7.0 beside 7.5."""
    labels = ["007", 7, 7.5, "1e3", {"a": 1}, [1, "x"], True, None]
    rows = [{"prompt": "1+1=", "label": label, **({"extra": i} if i % 2 else {})} for i, label in enumerate(labels)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    read = read_rows(path, "prompt", "label")
    assert [r["label"] for r in read] == labels
    assert [type(r["label"]) for r in read] == [type(label) for label in labels]
    assert [r["extra"] for r in read] == [None, 1, None, 3, None, 5, None, 7]  # every row has every column


def test_a_slice_of_the_rows_keeps_their_lines_and_prompts_carry_them(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text('\n{"prompt": "1+1=", "label": "2"}\n\n\n{"prompt": "2+2=", "label": "4"}\n'
                    '{"prompt": "3+3=", "label": "6"}\n')
    rows = read_rows(path, "prompt", "label")
    assert rows.lines == [2, 5, 6] and rows[1:].lines == [5, 6] and rows[1] == {"prompt": "2+2=", "label": "4"}
    prompts = encode_rows(rows[1:], tokenizer, prompt_key="prompt", label_key="label", chat_template="false")
    assert [(q.index, q.line, q.label) for q in prompts] == [(0, 5, "4"), (1, 6, "6")]
    assert where_in_file(path, prompts[0]) == "line 5"
    plain = encode_rows([{"prompt": "1+1="}], tokenizer, prompt_key="prompt", label_key="label", chat_template="false")
    assert plain[0].line is None and where_in_file(path, plain[0]) == "row 1"


# -- text the tokenizer cannot encode (it becomes <unk>) ----------------------------------------------------------


def prompts_of(tokenizer, texts):
    rows = Rows([{"prompt": text} for text in texts], range(1, len(texts) + 1))
    return encode_rows(rows, tokenizer, prompt_key="prompt", label_key="label", chat_template="false")


def test_prompts_with_unknown_characters_are_counted_and_refused_above_the_share(tokenizer, capsys):
    prompts = prompts_of(tokenizer, ["1+2=", "３+４=", "5+6=", "7+8=", "1+𝟐="])
    assert tokenizer.decode(prompts[1].prompt_ids) == "<unk>+<unk>="
    with pytest.raises(DataError) as err:
        check_unknown_tokens(prompts, tokenizer, "t.jsonl", 0.0)
    assert str(err.value) == (
        "2 of 5 prompt(s) of data file 't.jsonl' hold text the tokenizer cannot encode, which becomes '<unk>' (the "
        "model never sees it): line 2 (\"３+４=\"): '３' (U+FF13), '４' (U+FF14); also line 5. At most "
        "data.max_unk_prompt_frac=0 of the prompts may; normalise the text (e.g. Unicode NFKC), use a tokenizer that "
        "covers it, or raise data.max_unk_prompt_frac")
    with pytest.raises(DataError):
        check_unknown_tokens(prompts, tokenizer, "t.jsonl", 0.39)
    assert check_unknown_tokens(prompts, tokenizer, "t.jsonl", 0.4) == 2  # exactly the share: allowed, and said
    assert "data: 2 of 5 prompt(s) of data file 't.jsonl'" in capsys.readouterr().err
    assert check_unknown_tokens(prompts_of(tokenizer, ["1+2=", "3+4="]), tokenizer, "t.jsonl", 0.0) == 0
    assert capsys.readouterr().err == ""


def test_unknown_tokens_from_the_chat_template_are_told_apart(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"  # '<' '>' are not in it
    rows = Rows([{"prompt": "1+2="}], [1])
    prompts = encode_rows(rows, tokenizer, prompt_key="prompt", label_key="label", chat_template="auto")
    with pytest.raises(DataError, match=r"line 1 \(\"1\+2=\"\): its text encodes, the chat template's does not"):
        check_unknown_tokens(prompts, tokenizer, "t.jsonl", 0.0)


def test_unknown_characters_of_a_message_with_parts_are_those_of_its_text_parts(tokenizer):
    """An image part has no text: the JSON of the parts is not the prompt's text."""
    tokenizer.chat_template = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'text' %}"
                               "{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")
    parts = [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "1+２="}]}]
    prompts = encode_rows(Rows([{"prompt": parts}], [1]), tokenizer, prompt_key="prompt", label_key="label",
                          chat_template="auto")
    with pytest.raises(DataError) as err:
        check_unknown_tokens(prompts, tokenizer, "t.jsonl", 0.0)
    assert "'２' (U+FF12)" in str(err.value) and "'{'" not in str(err.value) and "'['" not in str(err.value)


def test_tokenizers_that_encode_any_text_never_report_unknown_tokens(tokenizer):
    from miles.models.vocabularies import build_bpe_tokenizer

    qwen = build_bpe_tokenizer("qwen", max_ranks=256)  # byte-level BPE: every byte is a token, no unk token
    assert unknown_token_id(qwen) is None
    assert check_unknown_tokens(prompts_of(qwen, ["３+４=", "💡 ½"]), qwen, "t.jsonl", 0.0) == 0
    assert unknown_token_id(tokenizer) == tokenizer.convert_tokens_to_ids("<unk>")
    tokenizer.unk_token = "<eos>"  # GPT-2 names its end-of-text token unk too, and never produces it for text
    assert unknown_token_id(tokenizer) is None


def test_a_run_refuses_unknown_characters_and_records_the_ones_it_allows(tmp_path, capsys):
    from miles.cli import main

    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(3) for b in range(3)] + [
        {"prompt": "３+４=", "label": "7"}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    args = ["configs/quickstart.yaml", "run.progress=false", "sft.steps=0", "run.steps=1", "run.eval_size=0",
            "rollout.prompts_per_step=2", "rollout.n_samples=2", "data.generator=null", f"data.train_path={path}"]
    assert main(["config", "--check", *args, f"run.dir={tmp_path / 'refused'}"]) == 2
    err = capsys.readouterr().err
    assert f"miles: error: 1 of 10 prompt(s) of data file '{path}' hold text the tokenizer cannot encode" in err
    assert "line 10 (\"３+４=\"): '３' (U+FF13), '４' (U+FF14)" in err
    assert main(["train", *args, f"run.dir={tmp_path / 'allowed'}", "data.max_unk_prompt_frac=0.1"]) == 0
    assert "(allowed: data.max_unk_prompt_frac=0.1)" in capsys.readouterr().err
    assert json.loads((tmp_path / "allowed" / "summary.json").read_text())["data/unk_prompts"] == 1
