"""Write docs/hooks.md from miles/hookspecs.py (a test checks the file is up to date).

    python docs/generate_hook_reference.py
"""

from __future__ import annotations

import inspect
from pathlib import Path

from miles import hookspecs

OUT = Path(__file__).resolve().parent / "hooks.md"


def signature(fn) -> str:
    params = ", ".join(inspect.signature(fn).parameters)
    return f"{fn.__name__}({params})"


def render() -> str:
    source = inspect.getsource(hookspecs)
    specs = [
        (source.index(f"\ndef {name}("), getattr(hookspecs, name))
        for name in dir(hookspecs)
        if name.startswith("miles_") and callable(getattr(hookspecs, name))
    ]
    lines = [
        "# Hook reference",
        "",
        "Generated from `miles/hookspecs.py` by `python docs/generate_hook_reference.py`; do not edit by hand.",
        "",
        inspect.cleandoc(hookspecs.__doc__ or ""),
        "",
    ]
    section = None
    for _, fn in sorted(specs, key=lambda item: item[0]):
        kind = "Registration hooks" if fn.__name__.startswith("miles_register_") else "Lifecycle hooks"
        if kind != section:
            lines += [f"## {kind}", ""]
            section = kind
        lines += [f"### `{signature(fn)}`", "", inspect.cleandoc(fn.__doc__ or ""), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
