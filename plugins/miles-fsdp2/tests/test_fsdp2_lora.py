"""LoRA (``backend.lora``) on the FSDP2 backend: two gloo workers against the single-process backend."""

import pytest
import torch

from miles.train.losses import ppo_clip
from miles.testing import make_train_batch
from miles.train.torch_backend import TorchBackend
from miles.weights.lora import merge_adapters
from miles_fsdp2 import FSDP2Backend

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def test_lora_steps_equal_the_single_process_backend_and_only_adapters_train(tiny_model_dir, tmp_path):
    """Same seed, same batches: loss and gradient norm within 1e-4 for two steps; the merged export and the
    adapters agree with the single-process backend's; base weights do not move; a checkpoint holds the adapters
    only; a backend resumed from it sends them as an adapter payload and its step repeats the uninterrupted one."""
    options = dict(lr=1e-2, max_grad_norm=0.5, lora=LORA)
    batches = [make_train_batch(seed=k, rows=9) for k in range(3)]

    single = TorchBackend(**options)
    single.setup(str(tiny_model_dir), seed=0)
    base = single.export_weights()
    single_metrics = [single.train_step(batch, ppo_clip) for batch in batches[:2]]
    single_merged = single.export_weights()
    single_third = single.train_step(batches[2], ppo_clip)
    single.shutdown()

    sharded = FSDP2Backend(world_size=2, **options)
    sharded.setup(str(tiny_model_dir), seed=0)
    try:
        assert all(torch.equal(t, base[k]) for k, t in sharded.export_weights().items())  # B = 0: the base
        sharded_metrics = [sharded.train_step(batch, ppo_clip) for batch in batches[:2]]
        for one, two in zip(single_metrics, sharded_metrics):
            assert two["train/loss"] == pytest.approx(one["train/loss"], abs=1e-4)
            assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], abs=1e-4)
        assert single_metrics[0]["train/grad_norm"] > 0

        merged = sharded.export_weights()
        assert set(merged) == set(base)
        changed = {k for k in merged if not torch.equal(merged[k], base[k])}
        # only the adapted layers' merged weights differ from the base: the rest did not train
        assert changed == {k for k in base if k.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))}
        for name in merged:
            torch.testing.assert_close(merged[name], single_merged[name], atol=1e-5, rtol=0)

        sharded.save_checkpoint(str(tmp_path))
        saved = torch.load(tmp_path / "state.pt", weights_only=False)["model"]
        assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
        sharded.save_pretrained(str(tmp_path / "hf"))
    finally:
        sharded.shutdown()

    # resumed with sync: adapters, from another seed: the checkpoint's adapters are what it sends
    resumed = FSDP2Backend(world_size=2, **{**options, "lora": {**LORA, "sync": "adapters"}})
    resumed.setup(str(tiny_model_dir), seed=1)
    try:
        resumed.load_checkpoint(str(tmp_path))
        payload = resumed.export_weights()
        third = resumed.train_step(batches[2], ppo_clip)
    finally:
        resumed.shutdown()
    # 2 layers x 3 adapted modules x (A, B, scaling), merging into the base exactly as the trainer merged them
    assert len(payload) == 18 and {float(v) for k, v in payload.items() if k.endswith("lora_scaling")} == {2.0}
    assert all(torch.equal(t, merged[k]) for k, t in merge_adapters(base, payload).items())
    assert third["train/loss"] == pytest.approx(single_third["train/loss"], abs=1e-4)
    assert third["train/grad_norm"] == pytest.approx(single_third["train/grad_norm"], abs=1e-4)

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for name, tensor in merged.items():
        assert torch.equal(exported[name], tensor), name
