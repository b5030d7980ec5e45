"""Where a test run's time went, from its JUnit XML (``pytest --junitxml FILE``; scripts/test.sh writes
``$TMPDIR/miles-tests-junit.xml``): the slowest tests, the slowest files, and the sum over all tests (on N workers the
run's wall time is about that sum over N).

    python scripts/slowest_tests.py [FILE] [--top 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path


def durations(path: Path) -> list[tuple[str, float]]:
    """(test id, seconds) of every test case in the file, the setup and teardown of its fixtures included."""
    cases = []
    for case in ElementTree.parse(path).iter("testcase"):
        module = case.get("classname", "")
        cases.append((f"{module}::{case.get('name', '')}", float(case.get("time") or 0.0)))
    return cases


def module_of(test: str) -> str:
    """``tests.test_x.TestY::test_z`` -> ``tests.test_x`` (a JUnit class name is the module, then the test class)."""
    parts = test.split("::")[0].split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():
        parts.pop()
    return ".".join(parts)


def summary(cases: list[tuple[str, float]], top: int) -> dict:
    files: dict[str, float] = defaultdict(float)
    for test, seconds in cases:
        files[module_of(test)] += seconds
    return {"tests": len(cases), "total_s": round(sum(s for _, s in cases), 1),
            "slowest_tests": [[t, round(s, 1)] for t, s in sorted(cases, key=lambda c: -c[1])[:top]],
            "slowest_files": [[f, round(s, 1)] for f, s in sorted(files.items(), key=lambda c: -c[1])[:top]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                                "miles-tests-junit.xml"))
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    path = Path(args.file)
    if not path.is_file():
        print(f"slowest_tests: {path} not found; expected the JUnit XML of a test run (pytest --junitxml FILE)",
              file=sys.stderr)
        return 2
    result = summary(durations(path), args.top)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['tests']} tests, {result['total_s']} s in all")
    for title, key in (("slowest tests", "slowest_tests"), ("slowest files", "slowest_files")):
        print(f"\n{title}:")
        for name, seconds in result[key]:
            print(f"  {seconds:8.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
