"""The work a chat format adds to each turn of a multi-turn rollout, per builtin format, on a real BPE vocabulary.

Per policy turn Miles renders the conversation twice (without and with the new messages), encodes the suffix,
decodes the generated turn and parses its reasoning and calls. This times that work on the scenario matrix's
conversations (one call, parallel calls, reasoning, follow-up user) and prints milliseconds per turn for each
format; compare with a turn's generation time (docs/benchmarks.md: the ReTool recipe's turns take hundreds of
milliseconds on 2 cores).

    python benchmarks/chat_formats.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

from miles.agentic.chat import Conversation
from miles.agentic.chat_check import SCENARIOS, TOOLS, scenario_messages
from miles.agentic.chat_format import bind
from miles.agentic.turns import read_turn
from miles.testing import make_registry
from miles.models.vocabularies import build_bpe_tokenizer


def per_turn_ms(bound, repeats: int) -> float:
    turns, spent = 0, 0.0
    for name in SCENARIOS:
        messages = scenario_messages(bound.format, name)
        if not messages:
            continue
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        for _ in range(repeats):
            conversation = Conversation(bound, messages[:first], TOOLS)
            k = first
            while k < len(messages):
                nxt = next((i for i in range(k + 1, len(messages)) if messages[i]["role"] == "assistant"),
                           len(messages))
                generated = conversation.encode(str(messages[k].get("content") or "x"))
                start = time.perf_counter()
                read_turn(bound, generated, TOOLS)
                conversation.add_policy_turn(messages[k], generated[-1])
                if nxt > k + 1:
                    conversation.extend(messages[k + 1:nxt], generation_prompt=nxt < len(messages))
                spent += time.perf_counter() - start
                turns += 1
                k = nxt
    return 1000 * spent / turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    registry = make_registry()
    print(f"{'format':<14} {'vocabulary':<10} ms per turn")
    for name in registry.names("chat_format"):
        fmt = registry.get("chat_format", name).obj
        vocabulary = "deepseek" if name.startswith("deepseek") else "qwen"
        tokenizer = build_bpe_tokenizer(vocabulary, (*fmt.identify, *fmt.all_stop_tokens))
        bound = bind(fmt, tokenizer, build_parser=lambda kind, n: registry.build(kind, {"name": n}, kind))
        print(f"{name:<14} {vocabulary:<10} {per_turn_ms(bound, args.repeats):.2f}")


if __name__ == "__main__":
    main()
