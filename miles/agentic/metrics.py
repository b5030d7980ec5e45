"""Per-step metrics of agentic rollouts, from what the rollout functions recorded on the samples."""

from __future__ import annotations

from statistics import fmean, quantiles
from typing import Any

from miles.types import Sample

__all__ = ["TITO_STATS", "TOOL_STATS", "agentic_metrics"]

# What an agentic rollout records per trajectory: sample.metadata["tools"] (multi_turn, the session server) and
# sample.metadata["tito"] (rollout.tito.on_mismatch's work), each a count per key.
TOOL_STATS = ("calls", "succeeded", "parse_errors", "schema_errors", "timeouts")
TITO_STATS = ("mismatches", "splits", "retokenized_tokens", "final_mismatches")


def agentic_metrics(samples: list[Sample], sandboxes: Any = None) -> dict[str, float]:
    """``rollout/observation_token_frac`` always; turns, tool calls, sandbox times and token-in-token-out
    mismatches for samples that recorded them (``metadata["tools"]`` and ``["tito"]``, filled by ``multi_turn``);
    with ``sandboxes`` a sandbox pool (``rollout.sandbox.pool``), what it did since the last step
    (:meth:`~miles.agentic.sandboxes.pool.SandboxPool.metrics`: sandboxes reused, discarded, started, ...)."""
    total = sum(len(s.response_ids) for s in samples)
    observed = sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples)
    metrics = {"rollout/observation_token_frac": observed / total if total else 0.0}
    pool_metrics = getattr(sandboxes, "metrics", None)
    if callable(pool_metrics):
        metrics.update(pool_metrics())
    agentic = [s for s in samples if "tools" in s.metadata]
    if not agentic:
        return metrics
    counts = {key: sum(s.metadata["tools"][key] for s in agentic) for key in agentic[0].metadata["tools"]}
    metrics.update({
        "turns/mean": fmean(s.turns for s in agentic),
        "turns/max": max(s.turns for s in agentic),
        "turns/cut": sum(s.metadata.get("turns_cut", 0) for s in agentic),  # at rollout.sampling.max_new_tokens
        "tools/calls": counts["calls"],
        "tools/success_rate": counts["succeeded"] / counts["calls"] if counts["calls"] else 0.0,
        "tools/parse_errors": counts["parse_errors"],
        "tools/schema_errors": counts["schema_errors"],
        "tools/timeouts": counts["timeouts"],
    })
    tito = [s.metadata["tito"] for s in agentic if "tito" in s.metadata]
    if tito:  # rollout.tito.on_mismatch: trajectories whose history was not append-only, and those split
        metrics["rollout/tito_mismatch_frac"] = sum(t["mismatches"] > 0 for t in tito) / len(tito)
        metrics["rollout/tito_split_frac"] = sum(t["splits"] > 0 for t in tito) / len(tito)
        metrics["rollout/tito_retokenized_tokens"] = sum(t["retokenized_tokens"] for t in tito)
        # found only once the trajectory ended: the template renders the finished conversation otherwise
        metrics["rollout/tito_final_mismatch_frac"] = sum(t.get("final_mismatches", 0) > 0 for t in tito) / len(tito)
    times = sorted(t for s in agentic for t in s.metadata.get("exec_s", ()))
    if times:
        cuts = quantiles(times, n=100, method="inclusive") if len(times) > 1 else [times[0]] * 99
        metrics["sandbox/exec_s_p50"], metrics["sandbox/exec_s_p99"] = cuts[49], cuts[98]
    return metrics
