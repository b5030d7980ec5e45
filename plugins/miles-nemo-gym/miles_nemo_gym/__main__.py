"""``python -m miles_nemo_gym``: set up the NeMo Gym venv and serve NeMo Gym servers from it.

    python -m miles_nemo_gym setup [--python /usr/bin/python3.12]   # build the venv once; prints its interpreter
    python -m miles_nemo_gym where                                   # the venv's interpreter, if built
    python -m miles_nemo_gym serve resources_servers/example_multi_step --port 8001
    python -m miles_nemo_gym serve responses_api_agents/simple_agent --port 8002 \\
        --ref resources_server=http://127.0.0.1:8001 --ref model_server=http://127.0.0.1:8003

``serve`` runs the server in the foreground (Ctrl-C stops it); its options are those of ``gym_server.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from miles_nemo_gym.venv import PYTHON_ENV, ensure_venv, is_built, venv_dir, venv_python


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # everything after it belongs to gym_server.py
        python = ensure_venv(quiet=False)
        script = str(Path(__file__).with_name("gym_server.py"))
        os.execv(str(python), [str(python), script, *argv[1:]])
    parser = argparse.ArgumentParser(prog="python -m miles_nemo_gym", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    setup = commands.add_parser("setup", help="build the NeMo Gym venv (once) and print its interpreter")
    setup.add_argument("--python", default=None, help=f"a Python >= 3.12 (default: ${PYTHON_ENV}, or one found)")
    commands.add_parser("where", help="print the venv's interpreter; exit 1 when it is not built")
    commands.add_parser("serve", help="serve a NeMo Gym server (see gym_server.py --help)")
    args = parser.parse_args(argv)
    if args.command == "setup":
        try:
            print(ensure_venv(args.python, quiet=False))
        except RuntimeError as exc:
            print(f"miles_nemo_gym: {exc}", file=sys.stderr)
            return 2
        return 0
    print(venv_python() if is_built() else f"not built yet: {venv_dir()} (python -m miles_nemo_gym setup)")
    return 0 if is_built() else 1


if __name__ == "__main__":
    sys.exit(main())
