"""Published chat templates, as the model makers ship them: the collection llama.cpp keeps in ``models/templates``
(each a model's ``tokenizer_config.json`` template), read from the ``llama-cpp-python`` source distribution on PyPI,
which vendors llama.cpp. Nothing of it is in this repository: the archive is fetched once with pip into
``$MILES_CACHE/published-templates`` (default ``~/.cache/miles``; ``scripts/test.sh`` fetches it before the suite).

    python tests/published_templates.py     # fetch it now
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
from functools import cache
from pathlib import Path

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
ARCHIVE = f"llama_cpp_python-{VERSION}.tar.gz"
MEMBER = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/templates/"


def folder() -> Path:
    return Path(os.environ.get("MILES_CACHE") or Path.home() / ".cache" / "miles") / "published-templates"


def fetch() -> Path:
    """The source archive, downloaded from PyPI the first time (a lock keeps parallel test workers to one pip)."""
    target = folder()
    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ARCHIVE).is_file():
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                                   ":all:", f"{PACKAGE}=={VERSION}", "-d", str(target)], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"pip download {PACKAGE}=={VERSION} (the published chat templates) failed:\n"
                                   f"{done.stderr[-2000:]}")
    return target / ARCHIVE


@cache
def _all() -> dict[str, str]:
    with tarfile.open(fetch()) as archive:
        return {m.name[len(MEMBER):-len(".jinja")]: archive.extractfile(m).read().decode()
                for m in archive.getmembers() if m.name.startswith(MEMBER) and m.name.endswith(".jinja")}


def published(name: str) -> str:
    """The template of ``name`` (its file name in llama.cpp, e.g. ``Qwen-QwQ-32B``)."""
    return _all()[name]


if __name__ == "__main__":
    print(fetch())
