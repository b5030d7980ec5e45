"""Every `miles train`, `miles eval` and `miles config` command of the README and the docs, copied literally, names
a config that loads and overrides that validate as plain `miles config` validates them (the keys exist, the values are
in range, the components are registered and accept their arguments, the backend takes its options, the batch
arithmetic works out): a renamed key or component breaks this test before it breaks a user.

Commands with placeholders (`RUN_DIR`, `MODEL_DIR`, `...`, `<...>`) are left out; the quickstart, the README's
plugin and each recipe also run end to end in tests of their own (test_quickstart, test_docs, the recipe tests)."""

import re
import shlex
from pathlib import Path

import pytest

from miles.config.prepared import prepare
from miles.run.settings import check_settings

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]{2,}\b|\.\.\.|<|\[[a-z ]+\]|\bN\b|my_")  # CONFIG, RUN_DIR, [overrides]


def commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        blocks = [block.replace("\\\n", " ") for block in re.findall(r"```bash\n(.*?)```", text, re.S)]
        lines = [line.split("  #")[0] for block in blocks for line in block.splitlines()]
        lines += re.findall(r"`(miles (?:train|eval|config) [^`]+)`", text)
        for line in (part.strip() for line in lines for part in re.split(r"&&|;", line)):
            # a command names its config (prose such as "`miles config --check` accepts" names none)
            if re.match(r"miles (train|eval|config) .*\.yaml", line) and not PLACEHOLDER.search(line):
                found.append((page.relative_to(ROOT).as_posix(), line))
    return list(dict.fromkeys(found))


COMMANDS = commands()


def test_the_docs_hold_commands_to_check():
    assert len(COMMANDS) > 30 and {page for page, _ in COMMANDS} >= {"README.md", "docs/your_model.md",
                                                                     "docs/lora.md", "docs/backends.md"}


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{p}: {c}" for p, c in COMMANDS])
def test_a_documented_command_validates_as_written(page, command, tmp_path, monkeypatch):
    from miles.run import settings

    for name in ("local_model_problem", "data_file_problem"):  # what earlier commands of the docs wrote is not here
        check = getattr(settings, name)
        monkeypatch.setattr(settings, name, lambda path, *more, check=check:
                            None if str(path).startswith("runs/") else check(path, *more))
    args = shlex.split(command)[2:]
    args = [a for i, a in enumerate(args) if not a.startswith("--") and not (i and args[i - 1] in ("--model",))]
    config, overrides = args[0], args[1:]
    assert (ROOT / config).is_file(), f"{page}: {command}: no such config {config}"
    prepared = prepare(str(ROOT / config), [*overrides, f"run.dir={tmp_path / 'run'}"])  # a ConfigError names the fault
    check_settings(prepared)  # the checks of plain `miles config` (the run directory: a fresh one here)
