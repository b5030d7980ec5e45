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


@hookimpl(trylast=True)
def miles_register_data_generators(register):
    register("addition", addition)
