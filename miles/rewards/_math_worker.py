"""The math reward's comparison process (run as a script; see :mod:`miles.rewards.math_answer`).

It prints ``{"ready": true}`` once math-verify is imported, then answers each request line
``{"gold", "answer", "timeout_s"}`` with ``{"equal": bool, "error": str | null}``. math-verify's own time
limits (``signal.alarm``, which works here: this is the main thread) keep it answering; the parent kills
it when they do not. It exits when its stdin closes, that is when the parent exits.
"""

import functools
import json
import logging
import math
import sys
import warnings


def main() -> None:
    logging.disable(logging.CRITICAL)  # math-verify logs every failed parse and time-out
    warnings.simplefilter("ignore")
    from math_verify import parse, verify

    @functools.lru_cache(maxsize=1024)  # a group's samples share their label
    def parse_gold(text: str, timeout: int) -> list:
        return parse(f"${text}$", parsing_timeout=timeout, raise_on_error=True)

    def compare(gold: str, answer: str, timeout_s: float) -> dict:
        timeout = max(1, math.ceil(timeout_s))
        try:
            expected = parse_gold(gold, timeout)
            if not expected:
                return {"equal": False, "error": f"the label {gold!r} does not parse as math"}
            found = parse(f"${answer}$", parsing_timeout=timeout, raise_on_error=True)
            if not found:
                return {"equal": False, "error": "the answer does not parse as math"}
            return {"equal": bool(verify(expected, found, timeout_seconds=timeout, raise_on_error=True)), "error": None}
        except Exception as exc:  # noqa: BLE001 - a time-out or a sympy failure on model output scores 0
            return {"equal": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}

    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        out.write(json.dumps(compare(request["gold"], request["answer"], request["timeout_s"])) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
