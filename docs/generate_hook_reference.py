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


def capabilities(source: str, start: int, end: int) -> list[str]:
    """The optional-capability Protocols defined between two hooks: their members and docstrings."""
    lines = []
    for name in hookspecs.__all__:
        obj = getattr(hookspecs, name)
        at = source.find(f"\nclass {name}(")
        if not (isinstance(obj, type) and start < at < end):
            continue
        members = [m for m in obj.__dict__.get("__annotations__", {})]
        members += [m for m, v in obj.__dict__.items()
                    if not m.startswith("_") and (callable(v) or isinstance(v, property))]
        lines += [f"- **`{name}`** (`{'`, `'.join(members)}`): {' '.join(inspect.cleandoc(obj.__doc__ or '').split())}"]
    return lines + [""] if lines else []


def render() -> str:
    source = inspect.getsource(hookspecs)
    specs = [
        (source.index(f"\ndef {name}("), getattr(hookspecs, name))
        for name in dir(hookspecs)
        if name.startswith("miles_") and callable(getattr(hookspecs, name))
    ]
    starts = sorted(at for at, _ in specs) + [len(source)]
    lines = [
        "# Hook reference",
        "",
        "Generated from `miles/hookspecs.py` by `python docs/generate_hook_reference.py`; do not edit by hand.",
        "",
        inspect.cleandoc(hookspecs.__doc__ or ""),
        "",
        "Optional capabilities are typed Protocols in `miles.hookspecs`, listed under the hook of their kind. "
        "Miles checks for one with `isinstance(component, Protocol)` (on the class, before it is built), and "
        "offers a constructor keyword (a sandbox's `workspace_root` and `run_id`) when "
        "`miles.hookspecs.takes_option` finds it.",
        "",
    ]
    section = None
    for at, fn in sorted(specs, key=lambda item: item[0]):
        kind = "Registration hooks" if fn.__name__.startswith("miles_register_") else "Lifecycle hooks"
        if kind != section:
            lines += [f"## {kind}", ""]
            section = kind
        lines += [f"### `{signature(fn)}`", "", inspect.cleandoc(fn.__doc__ or ""), ""]
        optional = capabilities(source, at, starts[starts.index(at) + 1])
        if optional:
            lines += ["Optional capabilities:", "", *optional]
    return "\n".join(lines)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
