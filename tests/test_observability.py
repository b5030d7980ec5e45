"""The tensorboard and wandb loggers record a real run (read back with each tool's own format), an
uninstalled one is refused at config time, and the progress bar shows reward and step time."""

import contextlib
import io
import json
import struct
import sys
from pathlib import Path

import pytest

from miles.cli import main

QUICK = ["configs/quickstart.yaml", "rollout.prompts_per_step=4", "rollout.n_samples=2", "run.eval_size=4"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def wandb_records(path: Path):
    """The records of a ``.wandb`` file: W&B's 7-byte header, then LevelDB's log format (32 KiB blocks of
    chunks, each ``crc32 u32, length u16, type u8``: full 1, first 2, middle 3, last 4), each record a
    ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, chunks = 7, []
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        chunks = [] if kind in (1, 2) else chunks
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            yield record


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb with no credentials and its own files under tmp_path; its service process stopped after."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    yield
    import wandb

    wandb.teardown()


def test_tensorboard_and_wandb_record_the_run(tmp_path, offline_wandb):
    run_dir = tmp_path / "run"
    loggers = ("run.loggers=[{name: jsonl}, {name: tensorboard}, "
               "{name: wandb, project: miles-test, run_name: quick, tags: [ci, tiny]}]")
    stderr = io.StringIO()  # not a terminal: plain progress lines
    with contextlib.redirect_stderr(stderr):
        code = main(["train", *QUICK, f"run.dir={run_dir}", "sft.steps=2", "run.steps=4", "run.save_every=2",
                     loggers])
    assert code == 0, stderr.getvalue()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in rows if "reward/mean" in row]
    assert [row["step"] for row in train_rows] == [0, 1, 2, 3] and rows[-1]["step"] == 4

    # plain lines with the reward and the step time, no carriage-return frames
    lines = stderr.getvalue().splitlines()
    assert "\r" not in stderr.getvalue()
    assert any(line.startswith("grpo: 4/4 (reward=") and "step_s=" in line for line in lines), lines
    assert any(line.startswith("sft: 2/2 (loss=") and "step_s=" in line for line in lines), lines
    # the long phases say when they start and end: evaluation (before and after RL), each checkpoint save
    evaluating = [line for line in lines if line.startswith("evaluating on ")]
    assert len(evaluating) >= 4 and evaluating[0].endswith(" ...") and ": done in " in evaluating[1], lines
    assert [line for line in lines if line.startswith("saving the checkpoint of step 2")][-1].startswith(
        "saving the checkpoint of step 2: done in "), lines

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for key in ("reward/mean", "time/step_s", "train/loss"):
        scalars = events.Scalars(key)
        assert [e.step for e in scalars] == [0, 1, 2, 3]
        assert [e.value for e in scalars] == pytest.approx([row[key] for row in train_rows], rel=1e-6)
    eval_accuracy = [(e.step, e.value) for e in events.Scalars("eval/accuracy")]
    assert eval_accuracy == [(4, pytest.approx(rows[-1]["eval/accuracy"]))]
    assert "config/text_summary" in events.Tags()["tensors"]

    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "the run was not offline"
    records = list(wandb_records(next(runs[0].glob("run-*.wandb"))))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name, list(run.tags)) == ("miles-test", "quick", ["ci", "tiny"])
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["run"]["steps"] == 4 and config["rollout"]["prompts_per_step"] == 4
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [0, 1, 2, 3, 4]
    assert [h["reward/mean"] for h in history[:4]] == pytest.approx([row["reward/mean"] for row in train_rows])
    assert history[4]["eval/accuracy"] == pytest.approx(rows[-1]["eval/accuracy"])
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished, not left open


def test_terminal_progress_bar_shows_reward_and_step_time(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # tqdm's width when the terminal cannot be asked: room for the postfix
    monkeypatch.setenv("LINES", "50")
    terminal = Terminal()
    with contextlib.redirect_stderr(terminal):
        code = main(["train", *QUICK, f"run.dir={tmp_path}", "sft.steps=0", "run.steps=2", "run.eval_size=0"])
    assert code == 0, terminal.getvalue()
    frames = terminal.getvalue().split("\r")
    assert any("2/2" in frame and "reward=" in frame and "step_s=" in frame for frame in frames), frames


def test_a_resumed_run_replaces_the_redone_steps_in_tensorboard(tmp_path):
    from omegaconf import OmegaConf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from miles.run.loggers import TensorBoardLogger

    config = OmegaConf.create({"run": {"resume": True}})
    for first_step, values in ((0, [1.0, 2.0, 3.0, 4.0]), (2, [30.0, 40.0])):  # interrupted after step 3, resumed at 2
        logger = TensorBoardLogger()
        logger.start(str(tmp_path), config)
        logger.rewind(first_step)
        for step, value in enumerate(values, first_step):
            logger.log(step, {"reward/mean": value, "note": "not a number"})
        logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(0, 1.0), (1, 2.0), (2, 30.0), (3, 40.0)]
    assert events.Tags()["scalars"] == ["reward/mean"]


@pytest.mark.parametrize("index, package", [(1, "tensorboard"), (2, "wandb")])
def test_logger_without_its_package_is_refused_at_config_time(index, package, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    code = main(["config", *QUICK, "run.loggers=[{name: jsonl}, {name: tensorboard}, {name: wandb}]"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"run.loggers[{index}]: logger '{package}'" in err and f"pip install 'miles[{package}]'" in err, err


def test_wandb_arguments_are_checked_at_config_time(capsys):
    code = main(["config", *QUICK, "run.loggers=[{name: wandb, mode: cloud, tags: solo}]"])
    err = capsys.readouterr().err
    assert code == 2
    assert "run.loggers[0]: logger 'wandb' rejected its arguments: mode: expected one of offline, online" in err, err


def test_plain_progress_prints_now_and_then(monkeypatch):
    from miles.run.progress import PlainProgress, progress

    out = io.StringIO()
    with progress(20, "grpo", enabled=True, file=out) as bar:
        assert isinstance(bar, PlainProgress)
        for step in range(20):
            bar.set_postfix(reward=f"{step / 20:.3f}", step_s="0.50")
            bar.update()
    assert out.getvalue().splitlines() == [f"grpo: {k}/20 (reward={(k - 1) / 20:.3f}, step_s=0.50)"
                                           for k in (2, 4, 6, 8, 10, 12, 14, 16, 18, 20)]
    assert type(progress(3, "x", enabled=True, file=Terminal())).__name__ == "tqdm"
