#!/usr/bin/env bash
# One GPU, SGLang installed: bash plugins/miles-sglang/scripts/gpu_check.sh MODEL_DIR  (about 5 minutes)
set -euo pipefail
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1
timeout 540 python plugins/miles-sglang/scripts/gpu_check.py "$1" --out "${OUT:-.}"
