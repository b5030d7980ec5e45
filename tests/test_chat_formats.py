"""Chat formats: every builtin format token-exact on the scenario matrix (real BPE vocabularies), detection,
the formats' stop tokens in every request, and what ``rollout.tito.on_mismatch`` does with a history that is not
append-only. Where a turn must be given text, ``Turns`` stands in for a trained policy: it answers each request
with the next scripted token ids and records what the rollout asked the engine for."""

import asyncio
import json

import pytest

from miles.agentic.chat import Conversation
from miles.agentic.chat_format import ChatFormat, bind, detect, generation_eos_ids, resolve
from miles.agentic.chat_check import _generated, check_format
from miles.cli import main
from miles.models.hf import read_chat_template
from miles.rollout.context import RolloutContext
from miles.rollout.multi_turn import MultiTurn
from miles.testing import make_registry
from miles.types import Sample, SampleStatus, TrainBatch
from miles.models.vocabularies import build_bpe_tokenizer

REGISTRY = make_registry()
FORMATS = {name: REGISTRY.get("chat_format", name).obj for name in REGISTRY.names("chat_format")}
BUILTIN = ("chatml", "qwen3", "qwq", "deepseek_r1", "deepseek_v3", "deepseek_v31", "llama3", "mistral_v3", "glm45",
           "gpt_oss", "kimi_k2")


def _vocabulary(name: str) -> str:
    return "deepseek" if name.startswith("deepseek") else "qwen"


def _bound(name: str, **kwargs):
    fmt = FORMATS[name]
    tokenizer = build_bpe_tokenizer(_vocabulary(name), (*fmt.identify, *fmt.all_stop_tokens))
    return bind(fmt, tokenizer, build_parser=lambda kind, n: REGISTRY.build(kind, {"name": n}, kind), **kwargs)


def test_every_family_of_the_issue_is_a_builtin():
    assert set(BUILTIN) <= set(FORMATS), sorted(set(BUILTIN) - set(FORMATS))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_check_command_finds_every_builtin_format_exact_on_a_real_vocabulary(name, capsys):
    assert main(["chat-format", "check", "--vocabulary", _vocabulary(name), "--chat-format", name]) == 0
    out = capsys.readouterr().out
    assert out.count("exact") >= 5 and "MISMATCH" not in out and "parse:" not in out, out


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_builtin_format_s_rendered_calls_and_reasoning_parse_back(name):
    results = check_format(_bound(name))
    assert all(r.ok for r in results), [(r.scenario, r.detail, r.parse_problems) for r in results if not r.ok]


STRIPPING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
             "{% if m.role == 'assistant' and not loop.last %}{{ m.content }}"
             "{% elif m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n"
             "{{ m.content }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_check_reports_a_template_that_drops_earlier_reasoning(tmp_path, capsys):
    """A template that keeps reasoning only in the last turn (as Qwen3's published one does before the last user
    message) is not append-only: the check names the scenario and the first token that differs."""
    (tmp_path / "strip.jinja").write_text(STRIPPING)
    code = main(["chat-format", "check", "--vocabulary", "qwen", "--chat-format", "qwen3", "--chat-template",
                 str(tmp_path / "strip.jinja")])
    out = capsys.readouterr().out
    assert code == 1
    assert "follow_up_user  MISMATCH" in out and "'<think>' became" in out, out


def test_thinking_off_reaches_the_template_and_the_prompt(capsys):
    fmt = _bound("qwen3", template_kwargs={"enable_thinking": False})
    conversation = Conversation(fmt, [{"role": "user", "content": "hi"}])
    assert fmt.tokenizer.decode(conversation.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert main(["chat-format", "check", "--vocabulary", "qwen", "--chat-format", "qwen3", "--template-kwargs",
                 '{"enable_thinking": false}']) == 0
    assert main(["chat-format", "check", "--vocabulary", "qwen", "--chat-format", "qwen3", "--template-kwargs",
                 "[1]"]) == 2


def test_detection_picks_the_family_by_its_template_and_refuses_an_ambiguous_vocabulary():
    qwen = build_bpe_tokenizer("qwen", ("<think>", "</think>"))
    qwen.chat_template = read_chat_template("qwen3")  # carries enable_thinking: Qwen3's marker
    fmt, candidates = detect(FORMATS, qwen)
    assert fmt.name == "qwen3" and {"chatml", "qwen3", "qwq"} <= set(candidates)
    qwen.chat_template = read_chat_template("chatml_tools")
    assert detect(FORMATS, qwen)[0].name == "chatml"
    # Qwen2.5's text models hold the vision tokens too: their template, not their vocabulary, tells them apart
    qwen = build_bpe_tokenizer("qwen", ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    qwen.chat_template = read_chat_template("chatml_tools")
    assert detect(FORMATS, qwen)[0].name == "chatml"
    qwen.chat_template = read_chat_template("qwen2_vl")
    assert detect(FORMATS, qwen)[0].name == "qwen2_vl"
    deepseek = build_bpe_tokenizer("deepseek")
    deepseek.chat_template = None
    with pytest.raises(ValueError,
                       match=r"several chat formats \(.*deepseek_r1.*deepseek_v3.*\).*set model.chat_format"):
        resolve(FORMATS, "auto", deepseek)
    from miles.models.hf import build_char_tokenizer

    assert resolve(FORMATS, "auto", build_char_tokenizer("abc")) == (
        None, "chat format: none detected (single-turn "
              "prompts use the tokenizer's chat template, if any)")


def test_a_format_needs_its_tokens_as_single_tokens():
    with pytest.raises(ValueError, match=r"glm45.* needs the token\(s\) .*<\|observation\|>"):
        bind(FORMATS["glm45"], build_bpe_tokenizer("qwen"))


def test_the_checkpoint_s_generation_eos_ids_are_stop_ids(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151643, 151645, 7]}))
    assert generation_eos_ids(tmp_path) == [151643, 151645, 7]
    fmt = _bound("qwen3", eos_ids=generation_eos_ids(tmp_path))
    assert {151643, 151645, 7} <= set(fmt.stop_ids)
    assert fmt.request_stop_ids([99]) == sorted({99, *fmt.stop_ids})


def test_a_generated_next_role_token_is_not_repeated_by_the_suffix():
    """GLM ends a turn by generating the next role token: the observation's tokens start after it."""
    fmt = _bound("glm45")
    tokenizer = fmt.tokenizer
    history = [{"role": "user", "content": "weather?"}]
    conversation = Conversation(fmt, history)
    observation = tokenizer.convert_tokens_to_ids("<|observation|>")
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    turn = conversation.encode(_generated(fmt, [*history, call], None) + "<|observation|>")  # the model's next role
    conversation.add_policy_turn(call, turn)
    suffix = conversation.extend([{"role": "tool", "tool_call_id": "call_0", "content": "sunny"}])
    assert suffix[0] != observation and observation not in suffix[:2]


# ---- multi_turn with a template that is not append-only: rollout.tito.on_mismatch -------------------------------


class Turns:
    """Stands in for the engine and a trained policy: answers request k with ``turns[k]`` (text, ended by the
    format's end-of-turn token) and records every request's sampling parameters."""

    def __init__(self, tokenizer, turns, eot="<|im_end|>"):
        self.tokenizer, self.turns, self.eot = tokenizer, list(turns), tokenizer.convert_tokens_to_ids(eot)
        self.requests = []

    async def generate(self, input_ids, sampling_params, return_logprob=True, **_):
        self.requests.append((list(input_ids), dict(sampling_params)))
        ids = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False) + [self.eot]
        return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[-0.5, i, None] for i in ids],
                                                  "finish_reason": {"type": "stop", "matched": self.eot},
                                                  "weight_version": 3}}


class GuessEnv:
    """Answers every turn as a user message (GuessNumber-style) until the third turn."""

    tools = []

    def __init__(self, ctx):
        self.steps = 0

    async def reset(self, sample):
        return None

    async def step(self, action):
        from miles.agentic.types import StepResult

        self.steps += 1
        return StepResult(observation="higher", done=self.steps >= 3, reward=1.0 if self.steps >= 3 else None)

    async def close(self):
        pass


def _play(on_mismatch, template=STRIPPING):
    fmt = FORMATS["qwen3"]
    tokenizer = build_bpe_tokenizer("qwen", fmt.all_stop_tokens)
    bound = bind(fmt, tokenizer, template=template,
                 build_parser=lambda kind, n: REGISTRY.build(kind, {"name": n}, kind))
    engine = Turns(tokenizer, ["<think>\nmaybe 5\n</think>\n\n5", "<think>\nthen 8\n</think>\n\n8",
                               "<think>\nso 9\n</think>\n\n9"])
    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, sampling_params={"max_new_tokens": 64}, env=GuessEnv,
                         chat_format=bound, tito_on_mismatch=on_mismatch)
    sample = Sample(prompt_ids=[], prompt="Guess my number.")
    asyncio.run(MultiTurn(max_turns=5)(sample, ctx))
    return sample, engine, tokenizer


def test_a_template_that_drops_reasoning_fails_the_sample_by_default_naming_the_turn():
    sample, _, _ = _play("fail")
    assert sample.status == SampleStatus.FAILED
    assert "after policy turn 1" in sample.reason and "'<think>' became" in sample.reason, sample.reason
    assert sample.metadata["tito"]["mismatches"] == 1


def test_split_continues_the_trajectory_as_a_new_sample_and_both_train():
    sample, engine, tokenizer = _play("split")
    assert sample.status == SampleStatus.COMPLETED and sample.turns == 3
    assert len(sample.segments) == 2 and sample.metadata["tito"]["splits"] == 2
    first = sample.segments[0]
    assert tokenizer.decode(first.response_ids).startswith("<think>\nmaybe 5\n</think>\n\n5<|im_end|>")
    # each part's prompt is the history as the template renders it then: what the engine was sent
    assert sample.prompt_ids == engine.requests[2][0] and sample.segments[1].prompt_ids == engine.requests[1][0]
    assert "maybe 5" not in tokenizer.decode(sample.prompt_ids)  # the template dropped it; the new part starts there
    # every generated token keeps its log-prob in the part that holds it
    for part in (*sample.segments, sample):
        assert [lp for lp, m in zip(part.rollout_logprobs, part.loss_mask) if m] == [-0.5] * sum(part.loss_mask)


def test_split_parts_share_their_trajectory_s_advantage_and_count_once_in_the_group():
    from miles.builtin.advantages import grpo
    from miles.loop.learner import segment_advantages

    split, _, _ = _play("split")
    plain, _, _ = _play("retokenize")
    split.reward, plain.reward = 1.0, 0.0
    rows = [split, plain, *split.segments]
    batch = TrainBatch.from_samples(rows, pad_token_id=0)
    advantages = segment_advantages(batch, grpo, [0, 0])
    # the group is the two trajectories: +-0.707 (std of {1, 0}), the split one's parts take its advantage
    per_row = (advantages.sum(1) / batch.loss_mask.sum(1)).tolist()
    assert per_row[0] == pytest.approx(0.7071, abs=1e-3) and per_row[1] == pytest.approx(-0.7071, abs=1e-3)
    assert per_row[2:] == pytest.approx([per_row[0]] * 2)


def test_retokenize_re_renders_and_leaves_the_changed_tokens_out_of_the_loss():
    sample, engine, tokenizer = _play("retokenize")
    assert sample.status == SampleStatus.COMPLETED and not sample.segments
    stats = sample.metadata["tito"]
    assert stats["mismatches"] == 2 and stats["retokenized_tokens"] > 0
    text = tokenizer.decode(sample.prompt_ids + sample.response_ids)
    assert "maybe 5" not in text and "then 8" not in text  # the history as the template renders it now
    # the last turn is the policy's own tokens; the re-rendered history before it is masked
    last = tokenizer.encode("<think>\nso 9\n</think>\n\n9", add_special_tokens=False)
    assert sample.response_ids[-len(last) - 1:-1] == last and sample.loss_mask[-len(last) - 1:] == [1] * (len(last) + 1)
    assert engine.requests[-1][0] == sample.prompt_ids + sample.response_ids[:-len(last) - 1]


def test_every_request_of_a_trajectory_carries_the_format_s_stop_tokens():
    sample, engine, tokenizer = _play("retokenize", template=read_chat_template("qwen3"))
    assert sample.status == SampleStatus.COMPLETED and sample.metadata["tito"]["mismatches"] == 0
    stops = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert len(engine.requests) == 3
    assert all(stops <= set(params["stop_token_ids"]) for _, params in engine.requests)


def test_the_naive_text_path_drifts_on_a_real_vocabulary_and_token_in_token_out_does_not():
    """A policy may sample a tokenization the tokenizer would not produce (' contin' 'uous' for ' continuous'):
    decoding and re-encoding its turn changes the ids; the trajectory keeps them."""
    fmt = _bound("qwen3")
    tokenizer = fmt.tokenizer
    whole = tokenizer.encode(" continuous", add_special_tokens=False)
    pieces = tokenizer.encode(" contin", add_special_tokens=False) + tokenizer.encode("uous", add_special_tokens=False)
    assert len(whole) == 1 and len(pieces) == 2
    assert tokenizer.encode(tokenizer.decode(pieces), add_special_tokens=False) == whole  # the naive path drifts
    engine = Turns(tokenizer, [])

    async def generate(input_ids, sampling_params, return_logprob=True, **_):
        out = pieces + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        return {"output_ids": out, "meta_info": {"output_token_logprobs": [[-1.0, i, None] for i in out],
                                                  "finish_reason": {"type": "stop"}, "weight_version": 0}}

    engine.generate = generate

    class OneTurn(GuessEnv):
        async def step(self, action):
            from miles.agentic.types import StepResult

            return StepResult(done=True)

    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, sampling_params={"max_new_tokens": 8}, env=OneTurn,
                         chat_format=fmt)
    sample = Sample(prompt_ids=[], prompt="Say it.")
    asyncio.run(MultiTurn()(sample, ctx))
    assert sample.response_ids[:2] == pieces  # token in, token out: the sampled pieces, not the re-encoded word


def test_model_chat_format_is_checked_at_start(tmp_path, capsys):
    code = main(["config", "configs/quickstart.yaml", "model.chat_format=qwen4"])
    assert code == 2 and "unknown chat_format 'qwen4'" in capsys.readouterr().err
    code = main(["config", "configs/quickstart.yaml", "rollout.tito.on_mismatch=ignore"])
    assert code == 2 and "fail, split or retokenize" in capsys.readouterr().err
    code = main(["config", "configs/quickstart.yaml", "rollout.tito.on_mismatch=split", "advantage.name=ppo"])
    assert code == 2 and "split trains a trajectory's earlier parts" in capsys.readouterr().err


def test_a_format_declaration_is_checked():
    with pytest.raises(ValueError, match="arguments must be 'json' or 'mapping'"):
        ChatFormat(name="x", end_of_turn=("<e>",), arguments="yaml")
    with pytest.raises(ValueError, match=r"tool_call_id may use \{index\} and \{name\}"):
        ChatFormat(name="x", end_of_turn=("<e>",), tool_call_id="call_{turn}")
    ids = {ChatFormat(name="x", end_of_turn=("<e>",), tool_call_id="alnum9").call_id(i, "f", "t") for i in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)


def test_the_guide_s_chat_format_plugin_registers_and_renders(chat_model_dir):
    import re
    import types
    from pathlib import Path

    from miles.models.hf import load_tokenizer

    guide = Path(__file__).parents[1].joinpath("docs", "agentic.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", guide, re.DOTALL) if "miles_register_chat_formats" in b)
    module = types.ModuleType("guide_chat_format")
    exec(code, module.__dict__)
    registry = make_registry(module)
    fmt = registry.get("chat_format", "chatml_python").obj
    bound = bind(fmt, load_tokenizer(chat_model_dir),
                 build_parser=lambda kind, n: registry.build(kind, {"name": n}, kind))
    conversation = Conversation(bound, [{"role": "user", "content": "2+2?"}])
    assert bound.tokenizer.decode(conversation.prompt_ids).endswith("<|im_start|>assistant\n")
    assert [c.arguments for c in bound.tool_parser.parse("```python\nprint(4)\n```")] == [{"code": "print(4)\n"}]


def test_the_session_server_reads_calls_written_in_special_tokens_through_the_openai_client():
    """DeepSeek-V3 writes its calls in special tokens: the session server parses them with the format's parser and
    answers OpenAI's client with tool_calls; the recorded tokens are the generated ones."""
    import aiohttp
    from openai import AsyncOpenAI

    from miles.session.server import SessionServer

    fmt = _bound("deepseek_v3")
    tokenizer = fmt.tokenizer
    call = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            "```json\n{\"city\": \"Paris\"}\n"
            "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    engine = Turns(tokenizer, [call], eot="<｜end▁of▁sentence｜>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

    async def main():
        server = SessionServer(engine, tokenizer, fmt.tool_parser, {"max_new_tokens": 64}, 4096, chat_format=fmt)
        url = await server.start()
        try:
            async with aiohttp.ClientSession() as http, http.post(f"{url}/sessions", json={}) as resp:
                sid = (await resp.json())["id"]
            async with AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused") as client:
                answer = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools)
            return answer, server.sessions[sid]
        finally:
            await server.stop()

    answer, session = asyncio.run(main())
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    [tool_call] = choice.message.tool_calls
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert session.response_ids == tokenizer.encode(call, add_special_tokens=False) + [engine.eot]
    assert set(fmt.stop_ids) <= set(engine.requests[0][1]["stop_token_ids"])


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_s_stop_tokens_reach_the_engine_and_its_turn_ends_the_trajectory(name):
    fmt = _bound(name)
    tokenizer = fmt.tokenizer
    answer = _generated(fmt, [{"role": "user", "content": "Weather?"},
                              {"role": "assistant", "content": "It is sunny."}], None)
    # what the family ends an answer with: its end of turn, or (GLM) the next role's token
    stop = next((t for t in fmt.format.all_stop_tokens if answer.endswith(t)), fmt.format.all_stop_tokens[-1])
    engine = Turns(tokenizer, [answer.removesuffix(stop)], eot=stop)

    class OneTurn(GuessEnv):
        async def step(self, action):
            from miles.agentic.types import StepResult

            return StepResult(done=True)

    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, sampling_params={"max_new_tokens": 16,
                                                                               "stop_token_ids": [7]},
                         env=OneTurn, chat_format=fmt)
    sample = Sample(prompt_ids=[], prompt="Weather?")
    asyncio.run(MultiTurn()(sample, ctx))
    assert sample.status == SampleStatus.COMPLETED, sample.reason
    sent = set(engine.requests[0][1]["stop_token_ids"])
    wanted = {tokenizer.convert_tokens_to_ids(t) for t in fmt.format.all_stop_tokens} | {tokenizer.eos_token_id, 7}
    assert wanted <= sent, (name, wanted - sent)
    assert sample.response_text.strip() == "It is sunny."
