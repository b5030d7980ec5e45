"""The part of a task's ``environment/Dockerfile`` that a Miles sandbox reproduces without Docker.

There is no image to start from: the sandbox's root is this machine's filesystem, read-only, and the
folders the task writes to (its ``WORKDIR``, where it copies files) are the sandbox's mounts. So:

- ``FROM`` names an image that is not used (a second ``FROM``, a multi-stage build, is refused);
- ``WORKDIR`` sets where later instructions and, at the end, every command start (folders are made);
- ``COPY`` and ``ADD`` of files and folders of the build context (``environment/``), globs included;
  ``--chown`` has no effect (commands run as one user), other flags, URLs and archives are refused;
- ``ENV`` is exported for ``RUN`` lines and every later command; ``ARG NAME=default`` for ``RUN`` lines;
- ``RUN`` runs at setup, in order, inside the sandbox (no network, read-only root): a line that fails
  fails the setup with its output, so a task that installs packages this way is refused with the reason;
- ``LABEL``, ``MAINTAINER``, ``EXPOSE``, ``CMD``, ``ENTRYPOINT``, ``HEALTHCHECK``, ``STOPSIGNAL``, ``USER``,
  ``VOLUME`` and ``ONBUILD`` have no effect here; ``SHELL``, heredocs, ``.dockerignore`` and anything else
  are refused with the reason.

Stdlib only: Harbor's side (its own Python) parses Dockerfiles with this module too.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Build", "DockerfileError", "Files", "Run", "Tree", "parse_dockerfile", "tree_of"]

IGNORED = {"LABEL", "MAINTAINER", "EXPOSE", "CMD", "ENTRYPOINT", "HEALTHCHECK", "STOPSIGNAL", "USER", "VOLUME",
           "ONBUILD"}
ARCHIVES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEREDOC = re.compile(r"(?<!<)<<(?!<)-?\s*['\"]?[A-Za-z_]")
_GLOB = re.compile(r"[*?\[]")


class DockerfileError(ValueError):
    """A Dockerfile this sandbox cannot reproduce; the message names the line and the reason."""


@dataclass
class Tree:
    """Files and folders to put in a sandbox: destination paths (absolute, inside the sandbox) of files
    on this machine, the destinations to mark executable (a sandbox writes files 0644) and the folders
    to make (empty ones included)."""

    files: dict[str, Path] = field(default_factory=dict)
    executables: list[str] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)

    def add_file(self, source: Path, dest: str) -> None:
        self.files[dest] = source
        if os.access(source, os.X_OK):
            self.executables.append(dest)

    def update(self, other: "Tree") -> None:
        self.files.update(other.files)
        self.executables += other.executables
        self.dirs += other.dirs


def tree_of(source: Path, dest: str) -> Tree:
    """The contents of folder ``source`` placed under ``dest``; a symlink in it is refused (ValueError)."""
    tree = Tree(dirs=[dest])
    for root, dirs, files in os.walk(source):
        rel = os.path.relpath(root, source)
        here = dest if rel == "." else posixpath.join(dest, Path(rel).as_posix())
        for name in sorted(dirs):
            if os.path.islink(os.path.join(root, name)):
                raise ValueError(f"{os.path.join(root, name)} is a symlink; only files and folders are copied")
            tree.dirs.append(posixpath.join(here, name))
        for name in sorted(files):
            path = Path(root, name)
            if path.is_symlink() or not path.is_file():
                raise ValueError(f"{path} is a symlink or not a regular file; only files and folders are copied")
            tree.add_file(path, posixpath.join(here, name))
    return tree


@dataclass
class Files:
    """Files (and folders) a ``COPY``/``ADD``/``WORKDIR`` puts in place."""

    line: int
    tree: Tree


@dataclass
class Run:
    """A ``RUN`` line: its command, the folder it starts in, the variables it sees (shell words, ``ENV``
    values expanded by the shell as Docker expands ``$VAR`` in them)."""

    line: int
    command: str
    workdir: str | None
    env: dict[str, str]


@dataclass
class Build:
    """What a Dockerfile does, in order, and where it leaves commands: ``workdir`` (None: the sandbox's
    own working directory) and ``env`` (``ENV``: exported for every command)."""

    steps: list[Files | Run] = field(default_factory=list)
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def paths(self) -> list[str]:
        """The absolute folders the build writes to (where the sandbox needs writable mounts)."""
        found = [self.workdir] if self.workdir else []
        for step in self.steps:
            if isinstance(step, Files):
                found += step.tree.dirs + [posixpath.dirname(p) for p in step.tree.files]
            else:
                found += [step.workdir] if step.workdir else []
        return sorted(set(found))

    def mounts(self, *folders: str) -> list[str]:
        """The sandbox's writable mounts for this build and ``folders``: the top-level folder of each path
        written to, and the working directory itself (commands start there, so it must exist)."""
        mounts = {"/" + p.strip("/").split("/")[0] for p in [*self.paths(), *folders]}
        return sorted(mounts | ({self.workdir} if self.workdir else set()))


def parse_dockerfile(path: Path) -> Build:
    """Parse the Dockerfile at ``path`` (its folder is the build context) into a :class:`Build`."""
    context = path.parent
    if (context / ".dockerignore").exists():
        raise DockerfileError(f"{path.name}: a .dockerignore is not supported (copy the files you need by name)")
    parser = _Parser(path.name, context)
    for line, instruction, args in _instructions(path.read_text(), path.name):
        parser.handle(line, instruction, args)
    return parser.build


def _instructions(text: str, where: str) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) for each instruction, continuation lines joined and
    comments dropped; a parser directive other than the default escape character is refused."""
    found, pending, start = [], "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        directive = re.match(r"#\s*escape\s*=\s*(\S+)", stripped)
        if directive and not found and not pending and directive.group(1) != "\\":
            raise DockerfileError(f"{where} line {number}: escape character {directive.group(1)!r} is not supported")
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = (pending + stripped).strip()
        pending = ""
        instruction, _, args = whole.partition(" ")
        found.append((start, instruction.upper(), args.strip()))
    if pending:
        raise DockerfileError(f"{where} line {start}: the last instruction ends with a line continuation")
    return found


class _Parser:
    def __init__(self, name: str, context: Path) -> None:
        self.name, self.context = name, context
        self.build = Build()
        self.args: dict[str, str] = {}
        self.known_dirs: set[str] = set()
        self.froms = 0

    def fail(self, line: int, reason: str) -> DockerfileError:
        return DockerfileError(f"{self.name} line {line}: {reason}")

    def handle(self, line: int, instruction: str, args: str) -> None:
        if instruction == "FROM":
            self.froms += 1
            if self.froms > 1:
                raise self.fail(line, "multi-stage builds (a second FROM) are not supported")
        elif instruction in IGNORED:
            return
        elif instruction == "WORKDIR":
            self.workdir(line, args)
        elif instruction in ("COPY", "ADD"):
            self.copy(line, instruction, args)
        elif instruction == "ENV":
            self.build.env.update(self.pairs(line, args, "ENV"))
        elif instruction == "ARG":
            self.build_arg(line, args)
        elif instruction == "RUN":
            self.run(line, args)
        else:
            raise self.fail(line, f"{instruction} is not supported here (supported: FROM, WORKDIR, COPY, ADD, "
                                  f"ENV, ARG, RUN; without effect: {', '.join(sorted(IGNORED))})")

    def absolute(self, line: int, path: str, what: str) -> str:
        if "$" in path:
            raise self.fail(line, f"{what} {path!r}: variables in paths are not supported")
        if not posixpath.isabs(path):
            if self.build.workdir is None:
                raise self.fail(line, f"{what} {path!r} is relative, but no WORKDIR is set before it")
            path = posixpath.join(self.build.workdir, path)
        path = posixpath.normpath(path)
        if path == "/":
            raise self.fail(line, f"{what}: the root folder is read-only in the sandbox; use a WORKDIR such as /app")
        return path

    def workdir(self, line: int, args: str) -> None:
        self.build.workdir = self.absolute(line, args.strip(), "WORKDIR")
        self.known_dirs.add(self.build.workdir)
        self.build.steps.append(Files(line, Tree(dirs=[self.build.workdir])))

    def words(self, line: int, instruction: str, args: str) -> tuple[list[str], bool]:
        """The arguments as words, and whether they came in the JSON (exec) form; like Docker, text that
        is not a valid JSON array of strings is the shell form."""
        if _HEREDOC.search(args):
            raise self.fail(line, f"{instruction} with a heredoc is not supported")
        if args.startswith("["):
            try:
                words = json.loads(args)
            except json.JSONDecodeError:
                words = None
            if isinstance(words, list) and all(isinstance(w, str) for w in words):
                return words, True
        return args.split(), False

    def copy(self, line: int, instruction: str, args: str) -> None:
        words, _ = self.words(line, instruction, args)
        while words and words[0].startswith("--"):
            flag = words.pop(0)
            if not flag.startswith(("--chown=", "--link")):
                raise self.fail(line, f"{instruction} {flag.split('=')[0]} is not supported (only --chown, "
                                      f"which has no effect: commands run as one user)")
        if len(words) < 2:
            raise self.fail(line, f"{instruction} needs a source and a destination")
        *sources, dest = words
        dest_path = self.absolute(line, dest, f"{instruction} destination")
        paths = [p for source in sources for p in self.sources(line, instruction, source)]
        into = dest.endswith("/") or len(paths) > 1 or dest_path in self.known_dirs or any(p.is_dir() for p in paths)
        tree = Tree()
        for path in paths:
            if path.is_dir():
                try:
                    tree.update(tree_of(path, dest_path))
                except ValueError as exc:
                    raise self.fail(line, f"{instruction}: {exc}") from None
            else:
                tree.add_file(path, posixpath.join(dest_path, path.name) if into else dest_path)
        self.known_dirs.update(tree.dirs)
        self.build.steps.append(Files(line, tree))

    def sources(self, line: int, instruction: str, source: str) -> list[Path]:
        if "://" in source:
            raise self.fail(line, f"{instruction} from a URL ({source}) is not supported: the sandbox has no network")
        root = self.context.resolve()
        if _GLOB.search(source):
            matches = sorted(root.glob(source.lstrip("/")))
            if not matches:
                raise self.fail(line, f"{instruction} {source!r} matches nothing in the build context")
        else:
            matches = [root / source.lstrip("/")]
        for path in matches:
            resolved = path.resolve()
            if resolved != root and root not in resolved.parents:
                raise self.fail(line, f"{instruction} {source!r} is outside the build context (environment/)")
            if not resolved.exists():
                raise self.fail(line, f"{instruction} {source!r}: no such file in the build context (environment/)")
            if instruction == "ADD" and resolved.is_file() and resolved.name.endswith(ARCHIVES):
                raise self.fail(line, f"ADD of the archive {source!r} (Docker would unpack it) is not supported; "
                                      f"unpack it in the task or use COPY")
        return [path.resolve() for path in matches]

    def pairs(self, line: int, args: str, instruction: str) -> dict[str, str]:
        """``KEY=value ...`` (values may be quoted) or the legacy ``KEY value``."""
        if "=" in args.split(" ", 1)[0]:
            try:
                words = shlex.split(args)
            except ValueError as exc:
                raise self.fail(line, f"{instruction}: {exc}") from None
            pairs = [word.partition("=") for word in words]
            if any(not eq for _, eq, _ in pairs):
                raise self.fail(line, f"{instruction}: expected KEY=value pairs, got {args!r}")
            found = {key: value for key, _, value in pairs}
        else:
            key, _, value = args.partition(" ")
            found = {key: value.strip()}
        for key in found:
            if not _NAME.match(key):
                raise self.fail(line, f"{instruction}: {key!r} is not a valid variable name")
        return found

    def build_arg(self, line: int, args: str) -> None:
        if "=" not in args:
            if not _NAME.match(args.strip()):
                raise self.fail(line, f"ARG: {args.strip()!r} is not a valid variable name")
            return  # no default: nothing to set
        self.args.update(self.pairs(line, args, "ARG"))

    def run(self, line: int, args: str) -> None:
        words, exec_form = self.words(line, "RUN", args)
        command = shlex.join(words) if exec_form else args
        if not command.strip():
            raise self.fail(line, "RUN without a command")
        self.build.steps.append(Run(line, command, self.build.workdir, {**self.args, **self.build.env}))
