"""Builtin synthetic data generators."""

from __future__ import annotations

import random

from miles import hookimpl


def addition(seed: int, max_operand: int = 9, eval_fraction: float = 0.2) -> dict[str, list[dict]]:
    """Prompts ``"a+b="`` with label ``"a+b"`` for ``0 <= a, b <= max_operand``.

    The pairs are split, not sampled: no held-out (eval) pair appears in the train split.
    """
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must lie in (0, 1), got {eval_fraction}")
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    n_eval = max(1, round(len(pairs) * eval_fraction))
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in pairs]
    return {"eval": rows[:n_eval], "train": rows[n_eval:]}


def tool_arithmetic(seed: int, digits: int = 2, ops: str = "*", size: int = 2000, eval_fraction: float = 0.1,
                    direct_fraction: float = 0.0, reasoning: bool = False) -> dict[str, list[dict]]:
    """Prompts ``"37*58="`` with label ``"2146"``: arithmetic a tiny model cannot do by itself but can by
    writing Python. Each row's ``messages`` is a trace for an SFT warm-up (``sft.messages_key:
    messages``): a python block that prints the result, the tool's output, the answer; in a
    ``direct_fraction`` of the rows, the answer alone (what the model cannot compute: it learns to guess,
    and RL to prefer the tool). With ``reasoning``, every assistant turn opens with a short
    ``<think>...</think>`` block, as a thinking model (Qwen3) writes it. Train and eval pairs are disjoint.
    """
    think = (lambda why, text: f"<think>\n{why}\n</think>\n\n{text}") if reasoning else (lambda why, text: text)
    if digits < 1 or size < 2 or not 0 < eval_fraction < 1 or not 0 <= direct_fraction <= 1 or not ops \
            or set(ops) - set("+-*"):
        raise ValueError("expected digits >= 1, size >= 2, eval_fraction in (0, 1), direct_fraction in [0, 1], "
                         "ops made of + - *")
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    seen, rows = set(), []
    while len(rows) < min(size, ((high - low + 1) ** 2) * len(set(ops))):
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(ops)
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        expression, value = f"{a}{op}{b}", str(eval(f"{a}{op}{b}"))  # noqa: S307 (digits and an operator)
        trace = [{"role": "assistant", "content": think("use python", f"```python\nprint({expression})\n```")},
                 {"role": "tool", "content": value + "\n"}]
        direct = rng.random() < direct_fraction
        answer = think("a guess" if direct else "the tool says", value)
        rows.append({"prompt": f"{expression}=", "label": value,
                     "messages": [*([] if direct else trace), {"role": "assistant", "content": answer}]})
    n_eval = max(1, round(len(rows) * eval_fraction))
    return {"eval": rows[:n_eval], "train": rows[n_eval:]}


@hookimpl(trylast=True)
def miles_register_data_generators(register):
    register("addition", addition)
    register("tool_arithmetic", tool_arithmetic)
