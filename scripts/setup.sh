#!/usr/bin/env bash
# Set Miles up in ./.venv: Miles with its test extras and every plugin of plugins/, at the versions of
# constraints.txt (the ones the tests ran with), and bubblewrap, the system package the local sandbox uses.
#   bash scripts/setup.sh            set up (about 5 minutes on a fresh 2-core machine)
#   bash scripts/setup.sh --print    print the commands it would run, run nothing
# Then: . .venv/bin/activate && miles train configs/quickstart.yaml
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
PLUGINS=(plugins/miles-fsdp2 plugins/miles-megatron plugins/miles-sglang plugins/miles-openenv plugins/miles-nemo-gym
         plugins/miles-harbor plugins/miles-verifiers plugins/miles-e2b plugins/miles-modal plugins/miles-daytona
         plugins/miles-kernels)
EDITABLE=(-e '.[test]')
for plugin in "${PLUGINS[@]}"; do EDITABLE+=(-e "$plugin"); done

run() {
    if [[ "${PRINT:-0}" == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}
case "${1:-}" in
    --print) PRINT=1 ;;
    "") ;;
    *) echo "usage: bash scripts/setup.sh [--print]" >&2; exit 2 ;;
esac

# bubblewrap isolates the code a model writes (the local sandbox); without it the sandbox runs with rlimits only
if ! command -v bwrap >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        run apt-get update -qq
        run apt-get install -y -qq bubblewrap
    else
        echo "setup: bwrap not found; install the 'bubblewrap' package (e.g. sudo apt-get install bubblewrap) for" \
             "sandboxed tool calls" >&2
    fi
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
run "$PYTHON" -m venv .venv
# The tested set exactly, as a lock file: nothing to resolve (pip's resolver took minutes of CPU over these ranges).
# It holds triton too: the Triton log-prob kernels of miles-kernels (compiled on GPUs only; their tests import it).
run .venv/bin/pip install --quiet --no-deps -r constraints.txt
run .venv/bin/pip install --quiet --no-deps --no-build-isolation "${EDITABLE[@]}"
run .venv/bin/pip check  # every installed package's requirements met: the lock and the ranges agree
[[ "${PRINT:-0}" == 1 ]] || echo "setup: done. Next: . .venv/bin/activate && miles train configs/quickstart.yaml"
