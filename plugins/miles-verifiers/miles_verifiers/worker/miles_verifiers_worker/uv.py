"""A stand-in for ``uv`` that runs verifiers' harness programs on the verifiers venv's own interpreter.

verifiers prepares a harness program (a PEP 723 script, e.g. the ``null`` and ``bash`` chat loops) with
``uv sync --script`` and runs it with the interpreter ``uv python find --script`` names; uv downloads the
script's dependencies at that moment. The programs bundled with verifiers need only packages verifiers itself
depends on (openai, mcp, httpx, ...), so the worker answers those two commands itself: ``sync`` checks that
the venv holds every dependency the script declares, ``python find`` names the venv's interpreter. Rollouts
thus need no network and run the versions pinned with verifiers. Any other uv command is refused, naming it.

The worker puts an executable ``uv`` that runs this module first on ``PATH`` (:func:`install`).
"""

from __future__ import annotations

import re
import stat
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

HELP = "uv stand-in of miles-verifiers: uv sync --script PATH, uv python find --script PATH"
BLOCK = re.compile(r"^# /// script$\n(?P<body>(^#(| .*)$\n)+)^# ///$", re.MULTILINE)


def install(folder: Path) -> Path:
    """Write the ``uv`` executable into ``folder`` (to go first on PATH); returns the folder."""
    script = folder / "uv"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return folder


def missing(script: Path) -> list[str]:
    """The script's declared dependencies this environment does not satisfy."""
    found = BLOCK.search(script.read_text())
    if found is None:
        return []
    meta = tomllib.loads("\n".join(line[2:] for line in found.group("body").splitlines()))
    absent = []
    for text in meta.get("dependencies", []):
        requirement = Requirement(text)
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            absent.append(text)
            continue
        if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
            absent.append(f"{text} (the venv has {installed})")
    return absent


def main(argv: list[str]) -> int:
    words = [a for a in argv if a not in ("-q", "--quiet", "--no-config")]
    if words[-1:] == ["--help"]:
        print(HELP)
        return 0
    if len(words) == 3 and words[:2] == ["sync", "--script"]:
        absent = missing(Path(words[2]))
        if absent:
            print(f"miles-verifiers: the harness program {words[2]} needs {', '.join(absent)}, which the verifiers "
                  f"venv ({sys.prefix}) lacks; install it there (python -m miles_verifiers --with ...)",
                  file=sys.stderr)
            return 1
        return 0
    if len(words) == 4 and words[:3] == ["python", "find", "--script"]:
        print(sys.executable)
        return 0
    print(f"miles-verifiers: `uv {' '.join(argv)}` is not supported by the uv stand-in (it only resolves "
          f"harness scripts to the verifiers venv); runtimes that build packages with uv need a real uv",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
