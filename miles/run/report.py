"""``miles report RUN_DIR``: PNG plots of a run's ``metrics.jsonl`` and a one-page HTML index with its summary.

Each plot needs some metrics; a run that lacks them gets the other plots, and the index says which were
skipped and why. matplotlib draws off-screen (Agg), without pyplot's global state.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.errors import ConfigError, DataError
from miles.loop.trajectories import trajectory_steps
from miles.run.viewer import RunTrajectories, completions_section, write_viewer

__all__ = ["PLOTS", "Plot", "Report", "write_report"]

_STEP_KEY = "time/step_s"
FIGURE_SIZE_IN = (6.4, 4.0)
DPI = 100


class Metrics:
    """The rows of ``metrics.jsonl``: one per step (eval rows carry only ``eval/*`` keys)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.keys = {key for row in rows for key in row}

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows where ``key`` holds a number (``jsonl`` writes a non-finite one as null)."""
        pairs = [(row["step"], float(row[key])) for row in self.rows
                 if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool)]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def has(self, key: str) -> bool:
        return bool(self.series(key)[0])


@dataclass(frozen=True)
class Plot:
    """One PNG: ``needs`` says why it cannot be drawn (None: it can), ``draw`` fills the axes."""

    name: str  # the file is <name>.png
    title: str
    needs: Callable[[Metrics], str | None]
    draw: Callable[[Any, Metrics, dict[str, Any]], None]
    family: str = ""  # what a run must be to have it (agentic, async, ...): left out, unlisted, of other runs


def _needs(*keys: str) -> Callable[[Metrics], str | None]:
    """The plot needs at least one of ``keys`` with a value."""
    def missing(metrics: Metrics) -> str | None:
        if any(metrics.has(key) for key in keys):
            return None
        absent = [key for key in keys if key not in metrics.keys]
        listed = " or ".join(f"`{key}`" for key in keys)
        return f"metrics.jsonl has no {listed}" if absent == list(keys) else f"{listed}: null in every row"
    return missing


def _needs_nonzero(key: str) -> Callable[[Metrics], str | None]:
    """The plot needs ``key`` with a value other than 0 (a share that is 0 in every run of another kind)."""
    def missing(metrics: Metrics) -> str | None:
        return None if any(metrics.series(key)[1]) else f"`{key}` is 0 or absent in every row"
    return missing


def _line(ax: Any, metrics: Metrics, key: str, label: str | None = None, **style: Any) -> None:
    steps, values = metrics.series(key)
    if steps:
        ax.plot(steps, values, label=label or key, **style)


_EVAL_REWARDS = {"eval/reward_mean": "held-out prompts, greedy", "eval/reward_mean_train": "training prompts, greedy"}


def _draw_reward(ax: Any, metrics: Metrics, summary: dict[str, Any]) -> None:
    steps, values = metrics.series("reward/mean")
    if steps:
        ax.plot(steps, values, linewidth=0.8, alpha=0.45, color="C0", label="sampled (reward/mean)")
        window = max(1, min(10, len(values) // 5))
        if window > 1:
            means = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                     for i in range(len(values))]
            ax.plot(steps, means, color="C0", label=f"sampled, mean of {window} steps")
    start = summary.get("eval_start") or {}
    for i, (key, label) in enumerate(_EVAL_REWARDS.items()):
        steps, values = metrics.series(key)
        if isinstance(start.get(key), (int, float)):  # the evaluation before the first step
            steps, values = [0, *steps], [float(start[key]), *values]
        if steps:
            ax.plot(steps, values, marker="o", markersize=4, color=f"C{i + 1}", label=f"{label} ({key})")
    # The eval section's datasets (eval/<name>/mean@n, pass@k), logged before the first step too.
    datasets = sorted(k for k in metrics.keys if k.startswith("eval/") and k.count("/") == 2
                      and k.rsplit("/", 1)[1].startswith(("mean@", "pass@")))
    for i, key in enumerate(datasets, start=len(_EVAL_REWARDS) + 1):
        steps, values = metrics.series(key)
        ax.plot(steps, values, marker="s", markersize=3, linestyle="--", color=f"C{i % 10}", label=key)
    ax.set_ylabel("reward")


def _draw_step_time(ax: Any, metrics: Metrics, summary: dict[str, Any]) -> None:
    phases = _time_phases(metrics)
    rows = [row for row in metrics.rows if any(isinstance(row.get(key), (int, float)) for key in phases)]
    steps = [row["step"] for row in rows]
    bottom = [0.0] * len(rows)
    parts = {key.removeprefix("time/").removesuffix("_s").replace("_", " "): [_number(row, key) for row in rows]
             for key in phases}
    if metrics.has(_STEP_KEY):  # what no phase timer covers (or what overlapped phases saved: clipped at 0)
        parts["other"] = [max(0.0, _number(row, _STEP_KEY) - sum(_number(row, key) for key in phases)) for row in rows]
    for label, values in parts.items():
        ax.bar(steps, values, bottom=bottom, width=0.8, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds")


def _time_phases(metrics: Metrics) -> list[str]:
    """The ``time/<phase>_s`` keys of a step's parts (``time/step_s`` is their total)."""
    return sorted(k for k in metrics.keys if k.startswith("time/") and k.endswith("_s") and k != _STEP_KEY
                  and metrics.has(k))


def _number(row: dict[str, Any], key: str) -> float:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def _draw_logprob_gap(ax: Any, metrics: Metrics, summary: dict[str, Any]) -> None:
    _line(ax, metrics, "train/rollout_logprob_abs_diff")
    if all(v > 0 for v in metrics.series("train/rollout_logprob_abs_diff")[1]):
        ax.set_yscale("log")
    ax.set_ylabel("mean |train - rollout| (nats/token)")


def _simple(key: str, ylabel: str, *more: str, from_zero: bool = True,
            log: bool = False) -> Callable[[Any, Metrics, dict[str, Any]], None]:
    """Lines of ``key`` and ``more``; the y axis from 0 (``from_zero``), or logarithmic when ``log`` and every value
    is positive."""
    def draw(ax: Any, metrics: Metrics, summary: dict[str, Any]) -> None:
        for k in (key, *more):
            _line(ax, metrics, k)
        ax.set_ylabel(ylabel)
        if log and all(v > 0 for k in (key, *more) for v in metrics.series(k)[1]):
            ax.set_yscale("log")
        elif from_zero:
            ax.set_ylim(bottom=0)
    return draw


_POOL_KEYS = tuple(f"sandbox/pool_{n}" for n in ("reused", "started", "discarded", "empty"))  # the pool's COUNTS


def _draw_kl(ax: Any, metrics: Metrics, summary: dict[str, Any]) -> None:
    """``train/kl``: to the reference model, or (the run has none: ``regularization.kl_coef`` 0) to the policy
    that sampled the batch, which the label says."""
    reference = ((summary.get("config") or {}).get("regularization") or {}).get("kl_coef")
    _line(ax, metrics, "train/approx_kl")
    to = ("the reference model" if reference else
          "the sampling policy: no reference model (regularization.kl_coef 0)" if reference is not None else None)
    _line(ax, metrics, "train/kl", f"train/kl, to {to}" if to else None)
    ax.set_ylabel("nats/token")


def _draw_lengths(ax: Any, metrics: Metrics, summary: dict[str, Any]) -> None:
    """Each step's response lengths: the 10th-90th percentile band, the median, the mean and the longest."""
    steps, low = metrics.series("response/length_p10")
    high = metrics.series("response/length_p90")[1]
    if steps and len(high) == len(low):
        ax.fill_between(steps, low, high, color="C0", alpha=0.2, linewidth=0, label="10th-90th percentile")
    _line(ax, metrics, "response/length_p50", "median", color="C0")
    _line(ax, metrics, "response/length_mean", "mean", color="C1", linewidth=0.8)
    _line(ax, metrics, "response/length_max", "longest", color="C3", linewidth=0.8, linestyle="--")
    ax.set_ylabel("tokens")
    ax.set_ylim(bottom=0)


PLOTS: list[Plot] = [
    Plot("reward", "Reward: training samples and evaluations", _needs("reward/mean", "eval/reward_mean"),
         _draw_reward),
    Plot("response_length", "Response length", _needs("response/length_mean", "response/length_p50"),
         _draw_lengths),
    Plot("truncation", "Truncated responses", _needs("rollout/truncated_frac"),
         _simple("rollout/truncated_frac", "fraction hitting max_new_tokens")),
    Plot("step_time", "Step time by phase", lambda m: None if _time_phases(m) else "metrics.jsonl has no "
         "`time/<phase>_s` key (e.g. `time/rollout_s`, `time/train_s`)", _draw_step_time),
    Plot("logprob_gap", "Log-prob gap", _needs("train/rollout_logprob_abs_diff"), _draw_logprob_gap),
    Plot("tokens_per_s", "Throughput", _needs("rollout/tokens_per_s"),
         _simple("rollout/tokens_per_s", "tokens / s", "train/tokens_per_s")),
    # RL health: what a practitioner checks when a run stops learning or blows up
    Plot("loss", "Training loss", _needs("train/loss"), _simple("train/loss", "loss", from_zero=False)),
    Plot("kl", "KL estimates", _needs("train/approx_kl", "train/kl"), _draw_kl),
    Plot("entropy", "Policy entropy", _needs("train/entropy"), _simple("train/entropy", "nats/token")),
    Plot("grad_norm", "Gradient norm (before clipping)", _needs("train/grad_norm"),
         _simple("train/grad_norm", "L2 norm", log=True)),
    Plot("clip_frac", "Clipped tokens", _needs("train/clip_frac"),
         _simple("train/clip_frac", "fraction of trained tokens clipped")),
    Plot("nonzero_advantage", "Samples with a learning signal", _needs("train/nonzero_adv_frac"),
         _simple("train/nonzero_adv_frac", "fraction with a non-zero advantage")),
    # agentic runs: tools, turns, what the environment wrote, sandboxes
    Plot("tool_calls", "Tool calls per step", _needs("tools/calls"),
         _simple("tools/calls", "calls", "tools/parse_errors", "tools/schema_errors", "tools/timeouts"),
         family="agentic"),
    Plot("tool_success", "Tool calls that succeeded", _needs("tools/success_rate"),
         _simple("tools/success_rate", "fraction of calls"), family="agentic"),
    Plot("turns", "Turns per sample", _needs("turns/mean"),
         _simple("turns/mean", "turns", "turns/max", "turns/cut"), family="agentic"),
    Plot("observation_share", "Response tokens from tools and environments",
         _needs_nonzero("rollout/observation_token_frac"),
         _simple("rollout/observation_token_frac", "fraction of response tokens (loss mask 0)"), family="agentic"),
    Plot("sandbox_times", "Sandbox times", _needs("sandbox/exec_s_p50", "sandbox/reset_s_p50"),
         _simple("sandbox/exec_s_p50", "seconds", "sandbox/exec_s_p99", "sandbox/reset_s_p50",
                 "sandbox/reset_s_p99", log=True), family="agentic"),
    Plot("sandbox_pool", "Sandbox pool per step", _needs(*_POOL_KEYS),
         _simple(_POOL_KEYS[0], "sandboxes", *_POOL_KEYS[1:]), family="agentic"),
    # asynchronous schedules
    Plot("staleness", "Staleness of the trained samples", _needs("async/staleness_mean"),
         _simple("async/staleness_mean", "weight versions behind", "async/staleness_max"), family="async"),
    Plot("async_waits", "Waits", _needs("async/trainer_wait_s", "async/rollout_wait_s"),
         _simple("async/trainer_wait_s", "seconds", "async/rollout_wait_s"), family="async"),
    # the engine against the trainer (low precision), and its correction
    Plot("mismatch", "Engine-trainer mismatch", _needs("train/rollout_kl"),
         _simple("train/rollout_kl", "KL(engine || trainer), nats/token", log=True), family="precision"),
    Plot("correction", "Tokens the importance-ratio correction clipped or masked", _needs("train/is_clipped_frac"),
         _simple("train/is_clipped_frac", "fraction of trained tokens"), family="precision"),
    # speculative rollouts
    Plot("speculation", "Speculative proposals kept", _needs("rollout/spec_accept_rate"),
         _simple("rollout/spec_accept_rate", "fraction kept"), family="speculation"),
    Plot("speculation_tokens", "Tokens per target forward", _needs("rollout/spec_tokens_per_forward"),
         _simple("rollout/spec_tokens_per_forward", "tokens"), family="speculation"),
    Plot("draft_loss", "Speculative draft's loss", _needs("rollout/spec_draft_loss"),
         _simple("rollout/spec_draft_loss", "KL to the policy (nats/token)", log=True), family="speculation"),
    # mixture-of-experts models
    Plot("routing", "Mixture-of-experts routing", _needs("train/routing_mismatch_frac", "moe/expert_load_max_frac"),
         _simple("train/routing_mismatch_frac", "fraction", "moe/expert_load_max_frac"), family="moe"),
]


@dataclass
class Report:
    out_dir: Path
    index: Path
    plots: dict[str, Path] = field(default_factory=dict)  # name: PNG file
    skipped: dict[str, str] = field(default_factory=dict)  # name: why
    trajectories: Path | None = None  # the static trajectory viewer's index.html (None: the run wrote none)


def read_metrics(run_dir: Path) -> Metrics:
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise DataError(f"miles report: {str(run_dir)!r} is not a directory; expected a run directory (run.dir)")
    if not path.is_file():
        raise DataError(f"miles report: {path} does not exist; is {str(run_dir)!r} a run directory whose run "
                        f"logged with the jsonl logger (run.loggers)?")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"miles report: {path}, line {number}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise DataError(f"miles report: {path}, line {number}: expected an object with an integer 'step'")
        rows.append(row)
    if not rows:
        raise DataError(f"miles report: {path} is empty: the run logged no step")
    return Metrics(rows)


def _matplotlib() -> tuple[Any, Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ConfigError("miles report needs matplotlib, which is not installed here: pip install 'miles[report]' "
                          "(or pip install matplotlib)") from None
    return Figure, FigureCanvasAgg, MaxNLocator


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Draw every plot the run's metrics allow into ``out_dir`` (default ``<run_dir>/report``) and write
    ``index.html`` there."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    Figure, FigureCanvasAgg, MaxNLocator = _matplotlib()
    summary = _read_json(run_dir / "summary.json")
    context = {**summary, "config": _read_yaml(run_dir / "config.yaml")}  # what the plots may say of the run
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, out / "index.html")
    for plot in PLOTS:
        reason = plot.needs(metrics)
        if reason is not None:
            if not plot.family:  # a plot of every run: the index says why it is missing
                report.skipped[plot.name] = reason
            (out / f"{plot.name}.png").unlink(missing_ok=True)  # a plot of an earlier report of other metrics
            continue
        figure = Figure(figsize=FIGURE_SIZE_IN, dpi=DPI, layout="constrained")
        FigureCanvasAgg(figure)
        ax = figure.add_subplot()
        plot.draw(ax, metrics, context)
        labels = ax.get_legend_handles_labels()[1]
        ax.set_title(f"{plot.title}: {labels[0]}" if len(labels) == 1 else plot.title, fontsize=11)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(ax.get_legend_handles_labels()[0]) > 1:  # below the axes, where it hides no data
            ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
        report.plots[plot.name] = out / f"{plot.name}.png"
        figure.savefig(report.plots[plot.name])
    trajectories = RunTrajectories(run_dir, "miles report") if trajectory_steps(run_dir) else None
    if trajectories is not None:
        report.trajectories = write_viewer(trajectories, out / "trajectories", back="../index.html")
    report.index.write_text(_index_html(run_dir, metrics, summary, report, trajectories), encoding="utf-8")
    return report


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, value in summary.items():
        if key == "plugins":
            continue
        if isinstance(value, dict):
            rows += [(f"{key}.{k}", _format(v)) for k, v in value.items()]
        else:
            rows.append((key, _format(value)))
    return rows


def _index_html(run_dir: Path, metrics: Metrics, summary: dict[str, Any], report: Report,
                trajectories: RunTrajectories | None) -> str:
    e = html.escape
    steps = sorted({row["step"] for row in metrics.rows if any(not k.startswith("eval/") for k in row if k != "step")})
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>Miles run {e(run_dir.name)}</title>",
             "<style>body{font-family:sans-serif;max-width:70em;margin:1em auto;padding:0 1em}"
             "table{border-collapse:collapse}td{padding:.1em .8em;border-bottom:1px solid #ddd}"
             "img{max-width:100%;display:block;margin:.5em 0 1.5em}</style></head><body>",
             f"<h1>Miles run <code>{e(str(run_dir))}</code></h1>",
             f"<p>{len(steps)} RL step(s) in metrics.jsonl"
             + (f" (steps {steps[0]} to {steps[-1]})" if steps else "") + ".</p>"]
    rows = _summary_rows(summary)
    if rows:
        parts.append("<h2>Summary</h2><table>" + "".join(
            f"<tr><td><code>{e(k)}</code></td><td>{e(v)}</td></tr>" for k, v in rows) + "</table>")
    else:
        parts.append("<p>No summary.json: the run has not finished (or was stopped).</p>")
    parts.append("<h2>Plots</h2>")
    for plot in PLOTS:
        if plot.name in report.plots:
            file = e(report.plots[plot.name].name)
            parts.append(f"<h3>{e(plot.title)}</h3><a href='{file}'><img src='{file}' alt='{e(plot.title)}'></a>")
    if report.skipped:
        parts.append("<h2>Skipped plots</h2><ul>" + "".join(
            f"<li><b>{e(name)}</b>: {e(why)}</li>" for name, why in report.skipped.items()) + "</ul>")
    parts.append(completions_section(trajectories))
    parts.append("</body></html>\n")
    return "\n".join(parts)
