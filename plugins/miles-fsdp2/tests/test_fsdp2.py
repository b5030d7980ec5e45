"""The FSDP2 backend on two real gloo worker processes (Ray actors) against the single-process backend."""

import json
import math

import pytest

from miles.train.losses import ppo_clip
from miles.errors import ConfigError, RunError
from miles.testing import BackendConformance, make_train_batch
from miles.train.torch_backend import TorchBackend
from miles_fsdp2 import FSDP2Backend

# The same run on one process: rewards equal but for a sample or two, losses within float noise (seen: all
# rewards equal, losses within 3e-8, resume included).
REWARD_TOLERANCE, LOSS_TOLERANCE = 2 / 128, 1e-4


class TestFSDP2Conformance(BackendConformance):
    split_options = ({"micro_batch_size": 6}, {"micro_batch_size": 1}, {"max_tokens_per_micro_batch": 14})

    def make_backend(self, **split):
        return FSDP2Backend(world_size=2, lr=1e-3, max_grad_norm=1e9, **split)


@pytest.mark.parametrize("split", [{}, {"max_tokens_per_micro_batch": 14}])
def test_first_steps_equal_the_single_process_backend(tiny_model_dir, split):
    """Same seed, same batches: loss and gradient norm agree within 1e-4 for three steps (clipping on)."""
    def steps(backend):
        backend.setup(str(tiny_model_dir), seed=0)
        out = [backend.train_step(make_train_batch(seed=k, rows=9), ppo_clip) for k in range(3)]
        backend.shutdown()
        return out

    single = steps(TorchBackend(lr=1e-2, max_grad_norm=0.5))
    sharded = steps(FSDP2Backend(world_size=2, lr=1e-2, max_grad_norm=0.5, **split))
    for one, two in zip(single, sharded):
        assert two["train/loss"] == pytest.approx(one["train/loss"], abs=1e-4)
        assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], abs=1e-4)
        assert two["train/entropy"] == pytest.approx(one["train/entropy"], abs=1e-4)
    assert single[0]["train/grad_norm"] > 0.5  # clipping was active, and matched


def test_a_moe_model_with_routing_replay_equals_the_single_process_backend(tmp_path):
    """Qwen3-MoE sharded over two workers, replaying given expert ids: loss, gradient norm and routing figures
    match one process for two steps."""
    import torch

    from miles.testing import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "moe", arch="qwen3_moe")
    gen = torch.Generator().manual_seed(0)
    batches = []
    for k in range(2):
        batch = make_train_batch(seed=k, rows=8)
        b, length = batch.input_ids.shape
        batch.routed_experts = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(b * length * 2)]
                                           ).reshape(b, length, 4).short()
        batch.routed_experts[0, :3] = -1  # routed by the trainer itself
        batches.append(batch)

    def steps(backend):
        backend.setup(str(model_dir), seed=0)
        out = [backend.train_step(batch, ppo_clip) for batch in batches]
        backend.shutdown()
        return out

    options = dict(lr=1e-2, max_grad_norm=0.5, routing_replay=True)
    single = steps(TorchBackend(**options))
    sharded = steps(FSDP2Backend(world_size=2, **options))
    for one, two in zip(single, sharded):
        for key in ("train/loss", "train/grad_norm", "train/routing_mismatch_frac"):
            assert two[key] == pytest.approx(one[key], abs=1e-4), key
        # each worker's aux loss is over its own micro-batch's expert loads (a product of means): close, not equal
        assert two["moe/aux_loss"] == pytest.approx(one["moe/aux_loss"], rel=0.05)
    assert single[0]["train/routing_mismatch_frac"] == 0.0 and single[1]["moe/aux_loss"] > 0.9


@pytest.mark.parametrize("options", [{"qat": "int4_w4a16"}, {"precision": "mxfp8"}], ids=["qat", "precision"])
def test_qat_and_low_precision_training_follow_the_single_process_backend(tiny_model_dir, options):
    """``backend.qat`` and ``backend.precision`` on two workers. The forward is the single process's to float
    rounding (each layer quantizes its whole weight: FSDP2 gathers it before the layer runs), and not a float
    run's. The backward: QAT's is float (straight-through), so the first gradient is the single process's too;
    low-precision training quantizes ``dW``'s operands in blocks along the tokens, and each worker's blocks are of
    its own tokens (as with data parallelism on GPUs), so its gradients are close, not equal (seen: 0.4%). After
    a step, a weight one rounding away from an INT4 step can round the other way: the second step is close."""
    def steps(backend):
        backend.setup(str(tiny_model_dir), seed=0)
        out = [backend.train_step(make_train_batch(seed=k, rows=9), ppo_clip) for k in range(2)]
        names = set(backend.export_weights())
        backend.shutdown()
        return out, names

    common = dict(lr=1e-2, max_grad_norm=0.5)
    (single, names), (plain, _) = steps(TorchBackend(**common, **options)), steps(TorchBackend(**common))
    sharded, sharded_names = steps(FSDP2Backend(world_size=2, **common, **options))
    assert sharded[0]["train/loss"] == pytest.approx(single[0]["train/loss"], abs=1e-6)
    assert abs(single[0]["train/loss"] - plain[0]["train/loss"]) > 1e-4  # the option does change the forward
    if "qat" in options:
        assert sharded[0]["train/grad_norm"] == pytest.approx(single[0]["train/grad_norm"], abs=1e-5)
    for one, two in zip(single, sharded):
        assert two["train/loss"] == pytest.approx(one["train/loss"], rel=1e-3)
        assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-2)
    assert sharded_names == names  # the quantized layers keep their parameters' names


def test_asking_for_more_workers_than_the_cluster_has_fails_at_once(tiny_model_dir):
    backend = FSDP2Backend(world_size=8)
    with pytest.raises(ConfigError, match=r"world_size=8 needs 8 CPU \(1 per worker\); the Ray cluster has 2 CPU"):
        backend.setup(str(tiny_model_dir), seed=0)


def test_a_dead_worker_fails_the_step_with_a_clear_error(tiny_model_dir, tmp_path):
    import ray

    from miles.run.checkpoint import latest_checkpoint, save_checkpoint

    backend = FSDP2Backend(world_size=2)
    backend.setup(str(tiny_model_dir), seed=0)
    backend.train_step(make_train_batch(), ppo_clip)
    saved = save_checkpoint(tmp_path, {"step": 1}, {}, backend, keep=2)
    files = {p: p.read_bytes() for p in saved.rglob("*") if p.is_file()}
    ray.kill(backend.workers[1])
    with pytest.raises(RunError, match="fsdp2 worker 1 died during train"):
        backend.train_step(make_train_batch(seed=1), ppo_clip)
    assert backend.workers == []  # its peer was stopped too, not left waiting in a collective
    assert latest_checkpoint(tmp_path).path == saved
    assert {p: p.read_bytes() for p in saved.rglob("*") if p.is_file()} == files  # the last checkpoint is intact


@pytest.mark.slow
def test_the_quickstart_on_fsdp2_follows_the_single_process_run_and_resumes(tmp_path):
    """The quickstart with backend.name=fsdp2 (two workers) takes the steps the single-process backend takes:
    the same rewards and losses, step by step (that run learns: tests/test_quickstart.py). Its engines get the
    gathered weights (trainer and engine log-probs agree), and a run resumed from its checkpoint continues it,
    each step once."""
    from miles.run.runner import prepare, train

    common = ["run.progress=false", "run.eval_size=0", "sft.steps=20", "run.save_every=4"]
    train(prepare(_quickstart(), [f"run.dir={tmp_path / 'torch'}", *common, "run.steps=8"]))
    args = [f"run.dir={tmp_path / 'fsdp2'}", *common, "backend.name=fsdp2", "backend.world_size=2"]
    train(prepare(_quickstart(), [*args, "run.steps=4"]))
    assert (tmp_path / "fsdp2" / "checkpoints" / "step_000004" / "backend" / "state.pt").is_file()
    train(prepare(_quickstart(), [*args, "run.steps=8", "run.resume=true"]))
    single, steps = _step_rows(tmp_path / "torch"), _step_rows(tmp_path / "fsdp2")
    assert [r["step"] for r in steps] == list(range(8))  # each step once, across the two runs
    assert [r["weight_version"] for r in steps] == list(range(1, 9))
    assert all(r["train/micro_batches"] == 2 for r in steps)  # one per worker
    assert max(r["train/rollout_logprob_abs_diff"] for r in steps) < 1e-4  # engines got the gathered weights
    for one, two in zip(single, steps):
        assert two["reward/mean"] == pytest.approx(one["reward/mean"], abs=REWARD_TOLERANCE), two["step"]
        assert two["train/loss"] == pytest.approx(one["train/loss"], abs=LOSS_TOLERANCE), two["step"]
        assert math.isfinite(two["train/grad_norm"])


def _step_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def _quickstart():
    from pathlib import Path

    return str(Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml")


def test_value_model_steps_equal_the_single_process_backend(tiny_model_dir):
    """PPO on FSDP2: values, the critic's loss and the policy's loss match one process (warm-up included)."""
    from miles.builtin.advantages import ppo

    def steps(backend):
        backend.setup(str(tiny_model_dir), seed=0, critic_model_path=str(tiny_model_dir))
        out = []
        for k in range(3):
            batch = make_train_batch(seed=k, rows=9)
            batch.values = backend.compute_values(batch)
            batch.advantages = ppo(batch)
            out.append(backend.train_step(batch, ppo_clip))
        backend.shutdown()
        return out

    single = steps(TorchBackend(lr=1e-2, critic_warmup_steps=1))
    sharded = steps(FSDP2Backend(world_size=2, lr=1e-2, critic_warmup_steps=1))
    assert sharded[0]["train/critic_warmup"] == 1.0 and "train/critic_warmup" not in sharded[1]
    for one, two in zip(single, sharded):
        for key in ("critic/loss", "critic/value_mean", "critic/grad_norm", "train/grad_norm"):
            assert two[key] == pytest.approx(one[key], abs=1e-4), key


@pytest.mark.slow
def test_async_schedule_trains_with_fsdp2(tmp_path):
    """run.schedule async over the FSDP2 backend: its gathered weights go to the engine while the stream
    generates the next batch; samples are at most one version old, every step trains a full batch."""
    from miles.run.runner import prepare, train

    train(prepare(_quickstart(), [f"run.dir={tmp_path}", "run.progress=false", "backend.name=fsdp2",
                                  "backend.world_size=2", "run.schedule=async", "rollout.async.update=in_place",
                                  "sft.steps=20", "run.eval_size=0", "run.steps=6"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(6))
    assert [r["weight_version"] for r in steps] == list(range(1, 7))
    assert all(r["async/staleness_max"] <= 1 and r["train/samples"] == 128 for r in steps)

