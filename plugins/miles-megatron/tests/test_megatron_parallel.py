"""Tensor and expert parallelism over two gloo worker processes, against the single-process torch backend."""

import pytest
import torch

from miles.train.losses import ppo_clip
from miles.testing import make_train_batch
from miles.train.torch_backend import TorchBackend
from miles_megatron import MegatronBackend

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    """A random-init Qwen3-MoE model (4 experts, top 2; layer 0 dense) over the tiny models' 15-token vocabulary."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=15, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                            tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("moe") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _run(backend, model_dir, steps=3):
    backend.setup(str(model_dir), seed=0)
    metrics = [backend.train_step(make_train_batch(seed=k, rows=9), ppo_clip) for k in range(steps)]
    weights = backend.export_weights()
    logprobs = backend.compute_logprobs(make_train_batch(seed=7))
    backend.shutdown()
    return metrics, weights, logprobs


def _same(one, two, tolerance):
    """Metrics and log-probs within ``tolerance``; weights within 1e-3, since AdamW's division by the
    root of the second moment magnifies float rounding in the gradients of weights whose gradient is ~0."""
    (m1, w1, l1), (m2, w2, l2) = one, two
    for a, b in zip(m1, m2):
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert b[key] == pytest.approx(a[key], abs=tolerance), key
    assert set(w1) == set(w2)
    for name in w1:
        assert (w1[name] - w2[name]).abs().max() < 1e-3, name
    mask = make_train_batch(seed=7).loss_mask.bool()
    assert (l1[mask] - l2[mask]).abs().max() < tolerance


def test_tensor_parallel_2_equals_the_torch_backend(tiny_model_dir):
    """TP=2 (vocabulary 15 padded to 16; heads, query groups, fc1 and the output layer split) with clipping on."""
    torch_run = _run(TorchBackend(lr=1e-2, max_grad_norm=0.5), tiny_model_dir)
    tp_run = _run(MegatronBackend(world_size=2, tensor_parallel=2, lr=1e-2, max_grad_norm=0.5), tiny_model_dir)
    assert torch_run[0][0]["train/grad_norm"] > 0.5  # clipping was active
    _same(torch_run, tp_run, 1e-4)


def test_expert_parallel_2_equals_the_torch_backend(tiny_moe_dir):
    """EP=2: two experts per worker, the dense weights data-parallel over the same two workers."""
    torch_run = _run(TorchBackend(lr=1e-2, max_grad_norm=0.5), tiny_moe_dir)
    ep_run = _run(MegatronBackend(world_size=2, expert_parallel=2, lr=1e-2, max_grad_norm=0.5), tiny_moe_dir)
    assert ep_run[0][0]["train/micro_batches"] == 2  # one per data-parallel rank
    _same(torch_run, ep_run, 1e-4)


def test_data_parallel_2_equals_the_torch_backend(tiny_model_dir):
    torch_run = _run(TorchBackend(lr=1e-2, max_grad_norm=0.5), tiny_model_dir)
    dp_run = _run(MegatronBackend(world_size=2, lr=1e-2, max_grad_norm=0.5, sequence_packing=True), tiny_model_dir)
    _same(torch_run, dp_run, 1e-4)


@pytest.mark.parametrize(("key", "value"), [("pipeline_parallel", 2), ("context_parallel", 2)])
def test_pipeline_and_context_parallel_reach_megatron_then_are_refused(tiny_model_dir, key, value):
    from miles.errors import ConfigError

    backend = MegatronBackend(world_size=2, **{key: value})
    with pytest.raises(ConfigError, match=f"backend.{key}={value}: megatron's parallel groups were built, but"):
        backend.setup(str(tiny_model_dir), seed=0)
    assert backend.workers == []


def test_tensor_parallel_2_takes_each_token_s_sampling_temperature(tiny_model_dir):
    """The output layer split over two ranks: the log-probs at the temperature the samples were drawn with
    (rollout.logprobs_of) are the torch backend's, and not the temperature-1 ones."""
    tempered, plain = make_train_batch(seed=7, temperature=0.4), make_train_batch(seed=7)
    torch_backend = TorchBackend()
    torch_backend.setup(str(tiny_model_dir), seed=0)
    expected, at_one = torch_backend.compute_logprobs(tempered), torch_backend.compute_logprobs(plain)
    backend = MegatronBackend(world_size=2, tensor_parallel=2)
    backend.setup(str(tiny_model_dir), seed=0)
    got = backend.compute_logprobs(tempered)
    backend.shutdown()
    mask = tempered.loss_mask.bool()
    assert (got - expected)[mask].abs().max() < 1e-5
    assert (got - at_one)[mask].abs().max() > 0.05
