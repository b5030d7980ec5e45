"""Pure parts: the Dockerfile subset, the shell script commands are wrapped in (run by /bin/sh), and how a
verifier's reward file becomes a Miles reward."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from miles_harbor.dockerfile import DockerfileError, Files, Run, parse_dockerfile
from miles_harbor.provision import script
from miles_harbor.verifier import VerifierError, parse_reward


def parse(tmp_path: Path, text: str, files: dict[str, str] | None = None):
    for name, content in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    (tmp_path / "Dockerfile").write_text(text)
    return parse_dockerfile(tmp_path / "Dockerfile")


def copied(build) -> dict[str, str]:
    return {dest: source.name for step in build.steps if isinstance(step, Files)
            for dest, source in step.tree.files.items()}


def test_copy_places_files_as_docker_does(tmp_path: Path) -> None:
    build = parse(tmp_path, "FROM python:3.12\nWORKDIR /app\nCOPY a.py .\nCOPY a.py /srv/renamed.py\n"
                            "COPY lib/ /app/lib/\nCOPY [\"a.py\", \"b.txt\", \"/data/\"]\nADD *.txt /glob/\n",
                  {"a.py": "", "b.txt": "", "lib/x.py": "", "lib/sub/y.py": "", "lib/empty/.keep": ""})
    assert copied(build) == {
        "/app/a.py": "a.py", "/srv/renamed.py": "a.py", "/app/lib/x.py": "x.py", "/app/lib/sub/y.py": "y.py",
        "/app/lib/empty/.keep": ".keep", "/data/a.py": "a.py", "/data/b.txt": "b.txt", "/glob/b.txt": "b.txt"}
    assert build.workdir == "/app"
    assert build.mounts("/logs", "/tests") == ["/app", "/data", "/glob", "/logs", "/srv", "/tests"]


def test_env_arg_run_and_continuations(tmp_path: Path) -> None:
    build = parse(tmp_path, "# syntax=docker/dockerfile:1\nFROM ubuntu AS base\nARG MODE=fast\n"
                            "ENV A=1 B=\"two words\"\nENV LEGACY value with spaces\n"
                            "RUN echo one && \\\n    # a comment inside\n    echo two\n"
                            "WORKDIR /app\nWORKDIR sub\nRUN [\"python3\", \"-c\", \"print(1)\"]\nRUN [ -d /app ]\n"
                            "EXPOSE 80\nUSER nobody\nCMD [\"bash\"]\n")
    runs = [step for step in build.steps if isinstance(step, Run)]
    assert [(r.line, r.command, r.workdir) for r in runs] == [
        (6, "echo one &&  echo two", None), (11, "python3 -c 'print(1)'", "/app/sub"), (12, "[ -d /app ]", "/app/sub")]
    assert runs[0].env == {"MODE": "fast", "A": "1", "B": "two words", "LEGACY": "value with spaces"}
    assert build.env == {"A": "1", "B": "two words", "LEGACY": "value with spaces"}  # ARG: RUN lines only
    assert build.workdir == "/app/sub" and build.mounts() == ["/app", "/app/sub"]


def test_executables_stay_executable(tmp_path: Path) -> None:
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    build = parse(tmp_path, "FROM x\nCOPY run.sh /app/run.sh\n")
    assert build.steps[0].tree.executables == ["/app/run.sh"]


@pytest.mark.parametrize("text, message", [
    ("FROM a\nFROM b\n", "line 2: multi-stage builds"),
    ("FROM a\nSHELL [\"bash\", \"-c\"]\n", "line 2: SHELL is not supported"),
    ("FROM a\nCOPY a.py app/\n", "line 2: COPY destination 'app/' is relative, but no WORKDIR"),
    ("FROM a\nWORKDIR /\n", "the root folder is read-only"),
    ("FROM a\nWORKDIR $HOME\n", "variables in paths are not supported"),
    ("FROM a\nCOPY ../secret /app/\n", "outside the build context"),
    ("FROM a\nCOPY missing.py /app/\n", "missing.py': no such file in the build context"),
    ("FROM a\nCOPY *.md /app/\n", r"'\*\.md' matches nothing"),
    ("FROM a\nADD https://x.org/f /app/\n", "from a URL .* no network"),
    ("FROM a\nADD data.tar.gz /app/\n", "ADD of the archive 'data.tar.gz'"),
    ("FROM a\nCOPY --chmod=755 a.py /app/\n", "COPY --chmod is not supported"),
    ("FROM a\nRUN <<EOF\necho hi\nEOF\n", "RUN with a heredoc"),
    ("FROM a\nENV 1BAD=x\n", "'1BAD' is not a valid variable name"),
    ("FROM a\nRUN echo \\\n", "ends with a line continuation"),
    ("# escape=`\nFROM a\n", "escape character '`'"),
])
def test_what_is_refused_says_why(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "ctx").mkdir()
    with pytest.raises(DockerfileError, match=message):
        parse(tmp_path / "ctx", text, {"a.py": "", "data.tar.gz": ""})


def test_symlinks_and_dockerignore_are_refused(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "link").symlink_to("/etc/passwd")
    with pytest.raises(DockerfileError, match="line 2: COPY: .*link is a symlink"):
        parse(tmp_path, "FROM a\nCOPY lib /app/lib\n")
    (tmp_path / ".dockerignore").write_text("*.pyc\n")
    with pytest.raises(DockerfileError, match=r"\.dockerignore is not supported"):
        parse(tmp_path, "FROM a\n")


def test_the_wrapping_script_exports_and_changes_folder(tmp_path: Path) -> None:
    tricky = "a \"quoted\" $HOME `x` \\ 'single'"
    command = script('printf "%s|%s|%s|%s" "$LITERAL" "$EXPANDED" "$QUOTED" "$(pwd)"',
                     dockerfile_env={"EXPANDED": "/opt/bin:$BASE", "QUOTED": 'say "hi"'},
                     env={"LITERAL": tricky}, cwd=str(tmp_path))
    out = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, env={"BASE": "/usr/bin"})
    assert out.stdout == f'{tricky}|/opt/bin:/usr/bin|say "hi"|{tmp_path}'


@pytest.mark.parametrize("kind, text, reward", [
    ("reward.txt", "1\n", 1.0),
    ("reward.txt", " 0.25 ", 0.25),
    ("reward.json", "0.5", 0.5),
    ("reward.json", '{"reward": 0.5, "style": 1}', {"reward": 0.5, "style": 1.0, "score": 0.5}),
    ("reward.json", '{"score": 0.2, "style": 1}', {"score": 0.2, "style": 1.0}),
    ("reward.json", '{"a": 1, "b": 0}', {"a": 1.0, "b": 0.0, "score": 0.5}),
])
def test_reward_files_become_rewards(kind: str, text: str, reward: object) -> None:
    assert parse_reward(kind, text, "t") == reward


@pytest.mark.parametrize("kind, text, message", [
    ("reward.txt", "", "holds '', expected a number"),
    ("reward.txt", "nan", "not a finite number"),
    ("reward.json", "{", "is not valid JSON"),
    ("reward.json", "{}", "expected a number or an object of named numbers"),
    ("reward.json", '{"a": "high"}', "expected a number or an object of named numbers"),
    ("reward.json", "true", "expected a number or an object of named numbers"),
    ("reward.json", '{"a": Infinity}', "a: the reward inf is not a finite number"),
])
def test_bad_reward_files_say_why(kind: str, text: str, message: str) -> None:
    with pytest.raises(VerifierError, match=f"task 't': /logs/verifier/{kind}.*{message}"):
        parse_reward(kind, text, "t")
