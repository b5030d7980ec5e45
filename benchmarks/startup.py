"""Start-up time of the commands: each run as a fresh process, as a user types it, the median of several runs.

    python benchmarks/startup.py [--repeats 5]

`import miles`, `miles --help`, `miles plugins` and `miles config` import no heavy package
(tests/test_light_imports.py); `miles config --check` and `miles train` import torch and transformers to load the
model and build the run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MILES = [sys.executable, "-m", "miles"]
COMMANDS = {
    "python -c 'import miles'": [sys.executable, "-c", "import miles"],
    "miles --help": [*MILES, "--help"],
    "miles plugins": [*MILES, "plugins"],
    "miles config configs/quickstart.yaml": [*MILES, "config", "configs/quickstart.yaml"],
    "miles config --check configs/quickstart.yaml": [*MILES, "config", "--check", "configs/quickstart.yaml"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for label, argv in COMMANDS.items():
        subprocess.run(argv, cwd=ROOT, capture_output=True, check=True)  # byte-code compiled, files cached
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            subprocess.run(argv, cwd=ROOT, capture_output=True, check=True)
            times.append(time.perf_counter() - start)
        print(f"{label:46s} median {statistics.median(times):6.2f} s  (min {min(times):.2f}, max {max(times):.2f}, "
              f"{args.repeats} runs)")


if __name__ == "__main__":
    main()
