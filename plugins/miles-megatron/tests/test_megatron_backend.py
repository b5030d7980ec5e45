"""The Megatron backend on real Ray worker processes (gloo on CPU) against the single-process backend."""

import os

import pytest
import torch

from miles.train.losses import ppo_clip
from miles.errors import ConfigError
from miles.testing import BackendConformance, make_train_batch
from miles.train.torch_backend import TorchBackend
from miles_megatron import MegatronBackend

pytestmark = pytest.mark.usefixtures("ray_cluster")


class TestMegatronConformance(BackendConformance):
    split_options = ({"micro_batch_size": 6}, {"micro_batch_size": 2}, {"max_tokens_per_micro_batch": 14},
                     {"micro_batch_size": 3, "sequence_packing": True})

    def make_backend(self, **split):
        # scripts/gpu_check.sh runs this suite with MILES_TEST_DEVICE=cuda
        device = os.environ.get("MILES_TEST_DEVICE", "auto")
        return MegatronBackend(world_size=1, lr=1e-3, max_grad_norm=1e9, device=device, **split)


def _steps(backend, model_dir, count=3):
    backend.setup(str(model_dir), seed=0)
    out = [backend.train_step(make_train_batch(seed=k, rows=9), ppo_clip) for k in range(count)]
    backend.shutdown()
    return out


@pytest.mark.parametrize("options", [{}, {"sequence_packing": True, "micro_batch_size": 4}])
def test_first_steps_equal_the_torch_backend(tiny_model_dir, options):
    """Same seed, same batches: loss, gradient norm and entropy within 1e-4 for three steps (clipping on)."""
    single = _steps(TorchBackend(lr=1e-2, max_grad_norm=0.5), tiny_model_dir)
    megatron = _steps(MegatronBackend(lr=1e-2, max_grad_norm=0.5, **options), tiny_model_dir)
    for one, two in zip(single, megatron):
        for key in ("train/loss", "train/grad_norm", "train/entropy", "train/kl"):
            assert two[key] == pytest.approx(one[key], abs=1e-4), key
    assert single[0]["train/grad_norm"] > 0.5  # clipping was active, and matched


@pytest.mark.parametrize(("arguments", "message"), [
    ({"world_size": 3, "tensor_parallel": 2},
     r"world_size=3 must be divisible by tensor_parallel x pipeline_parallel x context_parallel = 2"),
    ({"world_size": 2, "expert_parallel": 4}, r"backend.expert_parallel=4: world_size=2 must be divisible"),
    ({"tensor_parallel": 0}, r"backend.tensor_parallel must be an integer >= 1, got 0"),
    ({"distributed_optimizer": True}, r"backend.distributed_optimizer: .*optimizer.py"),
    ({"routing_replay": True}, r"backend.routing_replay=True: routing replay and the router's aux loss are not wired"),
    ({"router_aux_loss_coef": 0.01}, r"backend.router_aux_loss_coef=0.01: "),
])
def test_impossible_layouts_are_refused_when_built(arguments, message):
    with pytest.raises(ConfigError, match=message):
        MegatronBackend(**arguments)


@pytest.mark.parametrize(("arguments", "message"), [
    ({"world_size": 2, "expert_parallel": 2}, r"expert_parallel=2 needs a mixture-of-experts model"),
    ({"world_size": 8, "tensor_parallel": 8}, r"tensor_parallel=8 must divide the model's num_attention_heads \(4\)"),
])
def test_layouts_the_model_cannot_take_are_refused_at_setup(tiny_model_dir, arguments, message):
    backend = MegatronBackend(**arguments)
    with pytest.raises(ConfigError, match=message):
        backend.setup(str(tiny_model_dir), seed=0)
    assert backend.workers == []


def test_checkpoints_hold_megatron_distributed_weights(tiny_model_dir, tmp_path):
    """model/ is megatron.core.dist_checkpointing's format, written by a TP=2 run: a fresh one-process
    Megatron model (another layout) loads it, and its HF weights are the ones the run exported; a backend of
    another layout is refused when it resumes from it."""
    import ray

    from miles_megatron.checkpoint import hf_weights_from_checkpoint

    backend = MegatronBackend(world_size=2, tensor_parallel=2, lr=1e-2)
    backend.setup(str(tiny_model_dir), seed=0)
    backend.train_step(make_train_batch(), ppo_clip)
    backend.save_checkpoint(str(tmp_path))
    exported = backend.export_weights()
    backend.shutdown()
    assert (tmp_path / "model" / "metadata.json").is_file() and (tmp_path / "rank1.pt").is_file()
    loaded = ray.get(ray.remote(hf_weights_from_checkpoint).remote(str(tiny_model_dir), str(tmp_path)))
    assert set(loaded) == set(exported)
    for name, tensor in exported.items():
        assert torch.equal(loaded[name], tensor), name
    # A backend of another layout refuses to resume from it (its optimizer state is sharded for TP=2).
    other = MegatronBackend(world_size=2, tensor_parallel=1)
    other.setup(str(tiny_model_dir), seed=0)
    try:
        with pytest.raises(Exception, match="written with world_size=2 and .*'tp': 2"):
            other.load_checkpoint(str(tmp_path))
    finally:
        other.shutdown()


@pytest.mark.slow
def test_quickstart_trains_with_megatron(tmp_path):
    """The quickstart with backend.name=megatron: reward rises, the engine gets the converted weights
    (trainer and engine log-probs agree), and a resumed run continues from its checkpoint."""
    import json
    import math
    from pathlib import Path

    from miles.run.runner import prepare, train

    quickstart = str(Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml")
    args = [f"run.dir={tmp_path}", "run.progress=false", "backend.name=megatron", "run.save_every=50"]
    train(prepare(quickstart, [*args, "run.steps=100"]))
    assert (tmp_path / "checkpoints" / "step_000100" / "backend" / "model" / "metadata.json").is_file()
    summary = train(prepare(quickstart, [*args, "run.steps=140", "run.resume=true"]))
    assert summary["reward_end"] - summary["reward_start"] >= 0.2 and summary["reward_end"] >= 0.5, summary
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(140))
    assert max(r["train/rollout_logprob_abs_diff"] for r in steps) < 1e-4
    assert all(math.isfinite(r["train/grad_norm"]) for r in steps)
