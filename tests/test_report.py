"""``miles report``: a PNG per plot from a real run's metrics.jsonl, an HTML index linking them, the plots a
run without some metrics can have, and clear errors for what is not a run."""

import json
import shutil
import sys

import pytest

from miles.cli import main
from miles.run.report import DPI, FIGURE_SIZE_IN, PLOTS

# the plots of a quickstart run: those of every run, and the engine-trainer mismatch (logged by every run)
QUICKSTART_PLOTS = [plot for plot in PLOTS if not plot.family or plot.name == "mismatch"]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("report") / "run"
    assert main(["train", "configs/quickstart.yaml", f"run.dir={run_dir}", "sft.steps=2", "run.steps=6",
                 "rollout.prompts_per_step=4", "rollout.n_samples=2", "run.eval_size=4", "run.eval_every=3",
                 "run.progress=false"]) == 0
    return run_dir


def assert_drawn_png(path):
    """A PNG that matplotlib drew: the signature, the figure's size, and more than a blank canvas."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    pixels = imread(path)
    assert pixels.shape[:2] == (FIGURE_SIZE_IN[1] * DPI, FIGURE_SIZE_IN[0] * DPI), (path, pixels.shape)
    colors = {tuple(p) for p in pixels.reshape(-1, pixels.shape[2])[::7].tolist()}
    assert len(colors) > 20, (path, len(colors))  # axes, text, lines in several colours: not a blank image


def test_every_plot_is_drawn_and_linked(run_dir, capsys):
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {len(QUICKSTART_PLOTS)} plot(s)" in out and "skipped" not in out
    report = run_dir / "report"
    index = (report / "index.html").read_text()
    for plot in QUICKSTART_PLOTS:
        assert_drawn_png(report / f"{plot.name}.png")
        assert f"href='{plot.name}.png'" in index and f"src='{plot.name}.png'" in index
    for plot in set(PLOTS) - set(QUICKSTART_PLOTS):  # an agentic, async, speculative or MoE run's: left out
        assert not (report / f"{plot.name}.png").exists() and plot.name not in index
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "reward_end" in index and f"{summary['reward_end']:.4g}" in index
    assert "6 RL step(s)" in index and "Skipped" not in index


def test_a_run_without_some_metrics_gets_the_other_plots(run_dir, tmp_path, capsys):
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(run_dir / "summary.json", partial)
    removed = ("rollout/truncated_frac", "train/rollout_logprob_abs_diff")
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.append({k: v for k, v in row.items() if k not in removed and not k.startswith("time/")})
    (partial / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out_dir = partial / "plots"
    out_dir.mkdir()
    (out_dir / "truncation.png").write_bytes(b"stale")  # from an earlier report: removed, not left to mislead

    assert main(["report", str(partial), "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    skipped = {"truncation", "step_time", "logprob_gap"}
    assert f"wrote {len(QUICKSTART_PLOTS) - len(skipped)} plot(s)" in out
    index = (out_dir / "index.html").read_text()
    for plot in QUICKSTART_PLOTS:
        if plot.name in skipped:
            assert not (out_dir / f"{plot.name}.png").exists()
            assert f"skipped {plot.name}: metrics.jsonl has no" in out
            assert f"<li><b>{plot.name}</b>: metrics.jsonl has no" in index
        else:
            assert_drawn_png(out_dir / f"{plot.name}.png")
            assert f"src='{plot.name}.png'" in index
    assert "`rollout/truncated_frac`" in index and "`train/rollout_logprob_abs_diff`" in index


@pytest.mark.parametrize("content", [None, "", "\n"])
def test_missing_or_empty_metrics_is_an_error(content, tmp_path, capsys):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and ("does not exist" in err if content is None else "is empty" in err), err
    assert not (tmp_path / "report").exists()


def test_not_a_directory_and_bad_rows_are_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.5}\n{"step": 1, "rew\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "line 2: not JSON" in capsys.readouterr().err


def test_without_matplotlib_the_pip_command_is_named(run_dir, tmp_path, monkeypatch, capsys):
    for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    assert main(["report", str(run_dir), "--out", str(tmp_path)]) == 2
    assert "pip install 'miles[report]'" in capsys.readouterr().err


def test_each_step_records_its_response_length_spread_and_a_run_evaluates_along_the_way(run_dir, tmp_path):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward/mean" in row]  # a step's row (an evaluation before RL has its own)
    assert len(steps) == 6
    for row in steps:
        spread = [row[f"response/length_{k}"] for k in ("p10", "p50", "p90", "max")]
        assert spread == sorted(spread) and spread[0] <= row["response/length_mean"] <= spread[-1], row
    # by default (run.eval_every unset) a run evaluates at each fifth of its steps (after steps 2, 4, 6, 8), and at
    # the end (its own row, at step 10)
    assert main(["train", "configs/quickstart.yaml", f"run.dir={tmp_path / 'run'}", "sft.steps=0", "run.steps=10",
                 "rollout.prompts_per_step=2", "rollout.n_samples=2", "run.eval_size=4", "run.progress=false"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "eval/reward_mean" in row] == [1, 3, 5, 7, 10]


FAMILIES = {  # what each kind of run logs, and the plots it gets for it
    "agentic": ({"tools/calls": 5.0, "tools/parse_errors": 1.0, "tools/schema_errors": 0.0, "tools/timeouts": 0.0,
                 "tools/success_rate": 0.8, "turns/mean": 2.5, "turns/max": 4.0, "turns/cut": 0.0,
                 "rollout/observation_token_frac": 0.3, "sandbox/exec_s_p50": 0.02, "sandbox/exec_s_p99": 0.1,
                 "sandbox/reset_s_p50": 0.01, "sandbox/reset_s_p99": 0.05, "sandbox/pool_reused": 7.0,
                 "sandbox/pool_started": 1.0, "sandbox/pool_discarded": 0.0, "sandbox/pool_empty": 0.0},
                {"tool_calls", "tool_success", "turns", "observation_share", "sandbox_times", "sandbox_pool"}),
    "async": ({"async/staleness_mean": 0.5, "async/staleness_max": 1.0, "async/trainer_wait_s": 0.1,
               "async/rollout_wait_s": 0.2}, {"staleness", "async_waits"}),
    "precision": ({"train/is_clipped_frac": 0.02}, {"correction"}),
    "speculation": ({"rollout/spec_accept_rate": 0.8, "rollout/spec_tokens_per_forward": 2.4,
                     "rollout/spec_draft_loss": 0.05}, {"speculation", "speculation_tokens", "draft_loss"}),
    "moe": ({"train/routing_mismatch_frac": 0.01, "moe/expert_load_max_frac": 0.4}, {"routing"}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_run_gets_the_plots_of_what_it_is(run_dir, tmp_path, capsys, family):
    """The quickstart's metrics with those of an agentic, async, low-precision, speculative or MoE run added (each
    step's values varied): that family's plots are drawn too, and no other family's."""
    added, expected = FAMILIES[family]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({**row, **{k: v * (1 + 0.1 * (i % 3)) for k, v in added.items()}} if "reward/mean" in row else row)
        + "\n" for i, row in enumerate(rows)))
    assert main(["report", str(tmp_path)]) == 0
    assert f"wrote {len(QUICKSTART_PLOTS) + len(expected)} plot(s)" in capsys.readouterr().out
    for plot in PLOTS:
        drawn = (tmp_path / "report" / f"{plot.name}.png").exists()
        assert drawn == (plot in QUICKSTART_PLOTS or plot.name in expected), plot.name
    for name in expected:
        assert_drawn_png(tmp_path / "report" / f"{name}.png")


@pytest.mark.parametrize("config, label", [
    ({"regularization": {"kl_coef": 0.0}}, "train/kl, to the sampling policy: no reference model"),
    ({"regularization": {"kl_coef": 0.05}}, "train/kl, to the reference model"),
    ({}, "train/kl")])
def test_the_kl_panel_says_what_the_kl_is_measured_against(run_dir, config, label):
    from matplotlib.figure import Figure

    from miles.run.report import _draw_kl, read_metrics

    ax = Figure().add_subplot()
    _draw_kl(ax, read_metrics(run_dir), {"config": config})
    labels = ax.get_legend_handles_labels()[1]
    assert labels[-1].startswith(label) and (label != "train/kl" or labels[-1] == "train/kl"), labels
