"""The ``code_tests`` reward: the share of the label's tests that the response's Python code passes,
run in a sandbox (a ``sandbox`` node; the builtin ``local`` one by default)."""

from __future__ import annotations

import ast
import asyncio
import json
import math
import os
import re
import secrets
import weakref
from collections.abc import Mapping
from typing import Any

from miles.rewards.labels import require_label
from miles.types import Sample

__all__ = ["CodeTests", "last_python_block", "split_tests"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

# Runs in the sandbox's workspace. Each test runs in a process of its own (the solution, then the test, in
# one namespace), under its own time limit, with its output kept in files: code that prints, hangs, crashes
# or exits fails its test and no other. A test passes when its process, after the test, echoes a token that
# the harness hands it in a pipe (an early exit, even with code 0, does not). The harness's own verdict lines
# start with a token read from a file it deletes before any test runs, so that tested code cannot forge one.
HARNESS = r'''
import json, os, secrets, subprocess, sys
with open("tests.json") as f:
    spec = json.load(f)
os.remove("tests.json")
RUN = """
import os, sys
sys.path.insert(0, os.getcwd())
namespace = {"__name__": "solution"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
exec(compile(sys.argv[2], "<test>", "exec"), namespace)
sys.stdout.flush()
os.write(1, b"\\n" + os.read(int(sys.argv[1]), 64))
"""


def tail(path, size):
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - size))
        return f.read()


for i, test in enumerate(spec["tests"]):
    done = secrets.token_hex(16).encode()
    token_in, token_out = os.pipe()
    os.write(token_out, done)
    os.close(token_out)
    try:
        with open("stdout.txt", "wb") as out, open("stderr.txt", "wb") as err:
            code = subprocess.run([sys.executable, "-I", "-c", RUN, str(token_in), test], stdin=subprocess.DEVNULL,
                                  stdout=out, stderr=err, pass_fds=(token_in,), timeout=spec["timeout_s"]).returncode
        passed = tail("stdout.txt", len(done)) == done
        lines = tail("stderr.txt", 300).decode(errors="replace").strip().splitlines()
        error = lines[-1] if lines else "exited with code %d before the test finished" % code
        verdict = {"passed": passed, "error": "" if passed else error}
    except subprocess.TimeoutExpired:
        verdict = {"passed": False, "error": "timed out after %g s" % spec["timeout_s"]}
    finally:
        os.close(token_in)
    print(spec["token"], json.dumps({"test": i, **verdict}), flush=True)
'''


class CodeTests:
    """The share of tests passed by the code of the response's last fenced Python block (a block tagged
    ``python``/``py``/``python3``, else the last untagged one).

    The label holds the tests: a list of test snippets (e.g. ``assert f(2) == 4``), one test each; or one
    string of Python, whose top-level ``assert`` statements are the tests and whose other statements
    (imports, helpers) run before each. Each test runs in a process of its own in one sandbox, after the
    solution's code (run with ``__name__ == "solution"``), for at most ``test_timeout_s`` seconds; the whole
    run for at most ``run_timeout_s`` (tests not run by then fail). ``python`` is the interpreter inside the
    sandbox. At most ``max_concurrent`` samples run at once (0: one per CPU).

    Returns ``{"score": passed / total, "passed": n, "total": n}``; why tests failed is in
    ``sample.metadata["reward_info"]``. A label without tests fails the sample.
    """

    miles_components = {"sandbox": "sandbox"}  # a sandbox node, built (into a factory) before this constructor runs
    label_types = (str, list)  # the tests: a string of Python, or a list of test snippets (miles.hookspecs.NeedsLabel)

    def __init__(self, sandbox: Any = "local", test_timeout_s: float = 5.0, run_timeout_s: float = 30.0,
                 max_concurrent: int = 0, python: str = "python3") -> None:
        self.check_args({"test_timeout_s": test_timeout_s, "run_timeout_s": run_timeout_s,
                         "max_concurrent": max_concurrent})
        if isinstance(sandbox, (str, Mapping)) or not callable(sandbox):
            raise TypeError(f"sandbox: expected a sandbox factory; a config node ({sandbox!r}) is built by the "
                            f"registry (Registry.build) before it reaches this constructor")
        self.sandbox, self.python = sandbox, python
        self.test_timeout_s, self.run_timeout_s = float(test_timeout_s), float(run_timeout_s)
        self.max_concurrent = max_concurrent or os.cpu_count() or 1
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> Semaphore

    @staticmethod
    def check_args(args: dict[str, Any]) -> None:
        """Config validation (a ValueError names the argument)."""
        for key in ("test_timeout_s", "run_timeout_s"):
            if not (isinstance(args[key], (int, float)) and 0 < args[key] < math.inf):
                raise ValueError(f"{key}: expected a positive number of seconds, got {args[key]!r}")
        if isinstance(args["max_concurrent"], bool) or not isinstance(args["max_concurrent"], int) \
                or args["max_concurrent"] < 0:
            raise ValueError(f"max_concurrent: expected a whole number >= 0 (0: one per CPU), "
                             f"got {args['max_concurrent']!r}")

    async def __call__(self, sample: Sample) -> dict[str, float]:
        setup, tests = split_tests(require_label(sample.label, self.label_types))
        code = last_python_block(sample.response_text)
        if code is None:
            sample.metadata["reward_info"] = {"reason": "no ```python block in the response"}
            return {"score": 0.0, "passed": 0.0, "total": float(len(tests))}
        async with self._slot():
            verdicts, problem = await self._run(code, [f"{setup}\n{test}" if setup else test for test in tests])
        passed = sum(1 for v in verdicts.values() if v["passed"])
        failures = {str(i): verdicts[i]["error"] if i in verdicts else "not run" for i in range(len(tests))
                    if not verdicts.get(i, {}).get("passed")}
        sample.metadata["reward_info"] = {**({"reason": problem} if problem else {}),
                                          **({"failed": failures} if failures else {})}
        return {"score": passed / len(tests), "passed": float(passed), "total": float(len(tests))}

    async def _run(self, code: str, tests: list[str]) -> tuple[dict[int, dict], str | None]:
        """Each test's verdict by index (tests without one did not run), and what cut the run short."""
        token = secrets.token_hex(16)
        spec = json.dumps({"tests": tests, "timeout_s": self.test_timeout_s, "token": token})
        sandbox = self.sandbox()
        try:
            result = await sandbox.run(f"{self.python} -I harness.py", timeout_s=self.run_timeout_s,
                                       files={"solution.py": code.encode(), "harness.py": HARNESS.encode(),
                                              "tests.json": spec.encode()})
        finally:
            await sandbox.close()
        verdicts = {}
        for line in result.stdout.splitlines():
            if line.startswith(token + " "):
                verdict = json.loads(line[len(token) + 1:])
                verdicts[verdict["test"]] = verdict
        if result.timed_out:
            return verdicts, f"the run timed out after {self.run_timeout_s:g} s"
        if result.exit_code != 0:
            return verdicts, f"the test harness exited with code {result.exit_code}: {result.stderr.strip()[-300:]}"
        return verdicts, None

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._slots:  # a semaphore belongs to one event loop; each asyncio.run makes a new one
            self._slots[loop] = asyncio.Semaphore(self.max_concurrent)
        return self._slots[loop]


def last_python_block(text: str) -> str | None:
    """The code of the last fenced block tagged python (``py``, ``python3``), else of the last untagged one."""
    blocks = _FENCE.findall(text)
    for tags in (("python", "py", "python3"), ("",)):
        tagged = [code for tag, code in blocks if tag.lower() in tags]
        if tagged:
            return tagged[-1]
    return None


def split_tests(label: Any) -> tuple[str, list[str]]:
    """(setup code run before each test, the tests) of a label: a list of test snippets, or a string whose
    top-level asserts are the tests and whose other statements are the setup."""
    if isinstance(label, (list, tuple)) and label and all(isinstance(t, str) for t in label):
        return "", list(label)
    if isinstance(label, str):
        try:
            statements = ast.parse(label).body
        except SyntaxError as exc:
            raise ValueError(f"the label's tests are not valid Python: {exc}") from None
        tests = [ast.unparse(s) for s in statements if isinstance(s, ast.Assert)]
        setup = "\n".join(ast.unparse(s) for s in statements if not isinstance(s, ast.Assert))
        if tests:
            return setup, tests
        if setup:
            return "", [label]  # no top-level asserts (e.g. a check(candidate) call): the whole string is one test
    raise ValueError(f"the label holds no tests: expected a list of test snippets or a string of Python, got {label!r}")
