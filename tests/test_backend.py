"""The builtin torch backend and the models it writes."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.builtin.advantages import grpo
from miles.builtin.losses import ppo_clip
from miles.train.torch_backend import TorchBackend
from miles.types import Sample, SampleStatus, TrainBatch


def make_batch():
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(6):
        n = 2 + i % 3
        samples.append(Sample(
            prompt_ids=[4, 13, 5 + i % 2, 14], group_index=i // 3, response_ids=torch.randint(3, 14, (n,), generator=gen).tolist(),
            loss_mask=[1] * n, rollout_logprobs=[-2.0] * n, reward=float(i % 2), status=SampleStatus.COMPLETED,
        ))
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.advantages = grpo(batch)
    return batch


def grads_after_step(model_dir, micro_batch_size):
    backend = TorchBackend(lr=1e-3, micro_batch_size=micro_batch_size, max_grad_norm=1e9)
    backend.setup(str(model_dir), seed=0)
    metrics = backend.train_step(make_batch(), ppo_clip)
    return metrics, {n: p.grad.clone() for n, p in backend.model.named_parameters()}


def test_micro_batching_does_not_change_the_gradient(tiny_model_dir):
    whole, grads_whole = grads_after_step(tiny_model_dir, 6)
    split, grads_split = grads_after_step(tiny_model_dir, 2)
    assert whole["train/loss"] == pytest.approx(split["train/loss"], abs=1e-6)
    assert whole["train/grad_norm"] == pytest.approx(split["train/grad_norm"], rel=1e-5)
    for name in grads_whole:
        assert torch.allclose(grads_whole[name], grads_split[name], atol=1e-6), name


def test_training_step_changes_weights_and_export_matches(tiny_model_dir):
    backend = TorchBackend(lr=1e-2)
    backend.setup(str(tiny_model_dir), seed=0)
    before = {k: v.clone() for k, v in backend.export_weights().items()}
    metrics = backend.train_step(make_batch(), ppo_clip)
    assert {"train/loss", "train/grad_norm", "train/clip_frac"} <= set(metrics)
    after = backend.export_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_saved_model_loads_with_transformers_and_generates(tiny_model_dir, tmp_path):
    backend = TorchBackend()
    backend.setup(str(tiny_model_dir), seed=0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend.save_pretrained(str(tmp_path / "out"), tokenizer)
    assert (tmp_path / "out" / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = loaded_tok("3+4=", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert loaded_tok.decode(ids[0]) == "3+4="
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, backend.model.state_dict()[name]), name
