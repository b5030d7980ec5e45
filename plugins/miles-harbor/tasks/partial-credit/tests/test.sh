#!/bin/bash
# The verifier: one score per key of /app/summary.json and their mean as the headline "reward", as named
# rewards in /logs/verifier/reward.json (partial credit: {"reward": 0.5, "rows": 1.0, "total": 0.0} when only
# the row count is right).
python3 - <<'PY'
import json

try:
    with open("/app/summary.json") as f:
        summary = json.load(f)
except (OSError, ValueError):
    summary = {}
if not isinstance(summary, dict):
    summary = {}
total = summary.get("total")
scores = {
    "rows": float(summary.get("rows") == 4),
    "total": float(isinstance(total, (int, float)) and abs(total - 300.0) < 1e-6),
}
with open("/logs/verifier/reward.json", "w") as f:
    json.dump({"reward": sum(scores.values()) / len(scores), **scores}, f)
PY
