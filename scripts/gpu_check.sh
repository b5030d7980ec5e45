#!/usr/bin/env bash
# The GPU check: installs what it needs, then prints one JSON summary of
#   the quickstart on CUDA (bf16), the embedded engine's decode tokens/s and the torch backend's training
#   tokens/s for a random-init Qwen3 of about 0.5B parameters, weight-sync time for it, miles-megatron's
#   conformance tests on CUDA, a short run with miles-sglang engines when sglang installs, and FP8 / INT4 rollout,
#   INT4 QAT and MXFP8 training, and FP8 / INT4 SGLang engines on the stored form (docs/precision.md), and
#   speculative decoding in the embedded engine and in SGLang with a draft model (docs/speculative.md).
# About 15 minutes on one H200-class GPU (run it in two with --only where a command may take 10); each check has a
# time budget (scripts/gpu_check.py).
#
#   bash scripts/gpu_check.sh                    # on the GPU machine, from the repository root
#   bash scripts/gpu_check.sh --wheels DIR       # install from wheels in DIR (a machine without internet)
#   bash scripts/gpu_check.sh --dry-run          # here, on CPU, tiny sizes, nothing installed
#   bash scripts/gpu_check.sh --only precision sglang_precision speculative sglang_speculative   # some checks
#
# Writes the summary to $OUT/gpu_check.json as well when OUT is set. Exit code 0 when every check passed
# or was skipped (with the reason in the summary).
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
wheels=""
only=()
python="${PYTHON:-python3}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --wheels) wheels="$2"; shift ;;
    --python) python="$2"; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    --only) shift; only=("$@"); break ;;
    *) echo "gpu_check.sh: unknown argument $1 (expected --dry-run, --wheels DIR, --python PY, --only CHECK ...)" >&2
       exit 2 ;;
  esac
  shift
done

export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled

if [[ $dry_run == 0 ]]; then
  # A venv that sees the machine's own torch (a CUDA build): Miles' torch pin is for CPU machines, so the
  # packages go in without their dependencies, and only the missing dependencies are added.
  venv=.gpu-venv
  "$python" -m venv --system-site-packages "$venv"
  python="$venv/bin/python"
  pip_from=()
  [[ -n "$wheels" ]] && pip_from=(--no-index --find-links "$wheels")
  "$python" -m pip install -q "${pip_from[@]}" --no-deps -e . -e plugins/miles-megatron -e plugins/miles-sglang
  "$python" -m pip install -q "${pip_from[@]}" --no-deps torchao==0.18.0 compressed-tensors==0.20.0 loguru
  missing=$("$python" - <<'EOF'
import importlib.metadata as md, re, tomllib
wanted = set()
for path in ("pyproject.toml", "plugins/miles-megatron/pyproject.toml", "plugins/miles-sglang/pyproject.toml"):
    for dep in tomllib.load(open(path, "rb"))["project"].get("dependencies", []):
        name = re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0]
        if name.lower() not in ("torch", "miles"):
            wanted.add((name, dep))
out = []
for name, dep in sorted(wanted):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        out.append(dep)
print(" ".join(out))
EOF
)
  if [[ -n "$missing" ]]; then
    # shellcheck disable=SC2086  # one word per requirement
    "$python" -m pip install -q "${pip_from[@]}" $missing
  fi
  "$python" -m pip install -q "${pip_from[@]}" sglang >/dev/null 2>&1 \
    || echo "gpu_check.sh: sglang did not install; its check is skipped" >&2
fi

args=()
[[ $dry_run == 1 ]] && args+=(--dry-run)
[[ -n "${OUT:-}" ]] && args+=(--out "$OUT/gpu_check.json")
[[ ${#only[@]} -gt 0 ]] && args+=(--only "${only[@]}")
exec "$python" scripts/gpu_check.py "${args[@]}"
