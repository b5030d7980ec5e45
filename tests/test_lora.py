"""LoRA through peft (``backend.lora``): what trains, what is exported, synced to engines, checkpointed and saved."""

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.train.losses import ppo_clip
from miles.cli import main
from miles.engine.local import LocalEngine
from miles.errors import ConfigError
from miles.rollout.plane import RolloutPlane
from miles.engine.router import Router
from miles.testing import BackendConformance, free_port, make_train_batch
from miles.train.torch_backend import TorchBackend
from miles.weights.transports import InProcessTransport, SharedMemoryTransport, TensorTransport

LORA = {"rank": 4, "alpha": 8}  # all-linear: 2 layers x 7 projections; scaling alpha / rank = 2
PROMPT = [5, 13, 2, 14]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def is_adapter(name):
    return ".lora_A." in name or ".lora_B." in name


def trained_backend(model_dir, steps=2, seed=0, **lora):
    backend = TorchBackend(lr=1e-2, lora={**LORA, **lora})
    backend.setup(str(model_dir), seed=seed)
    for k in range(steps):
        backend.train_step(make_train_batch(seed=k, rows=9), ppo_clip)
    return backend


def test_only_the_adapters_train_and_the_base_stays_bit_identical(tiny_model_dir):
    backend = TorchBackend(lr=1e-2, lora=LORA)
    backend.setup(str(tiny_model_dir), seed=0)
    model = backend.model
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable == {name for name, _ in model.named_parameters() if is_adapter(name)} and len(trainable) == 28
    # the optimizer holds the adapters only
    assert sum(len(group["params"]) for group in backend.policy.optimizer.param_groups) == 28
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    metrics = [backend.train_step(make_train_batch(seed=k, rows=9), ppo_clip) for k in range(2)]
    assert all(m["train/grad_norm"] > 0 for m in metrics)
    after = model.state_dict()
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    assert changed == trainable  # every adapter moved (B first, then A), nothing else did, bit for bit


def test_the_merged_export_is_w_plus_alpha_over_rank_b_a(tiny_model_dir):
    backend = trained_backend(tiny_model_dir)
    merged = backend.export_weights()
    assert set(merged) == set(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict())  # plain HF names
    state = backend.model.state_dict()
    layers = [name.removesuffix(".lora_A.default.weight") for name in state if name.endswith(".lora_A.default.weight")]
    assert len(layers) == 14
    for layer in layers:
        w, a, b = (state[f"{layer}.{part}"] for part in ("base_layer.weight", "lora_A.default.weight",
                                                          "lora_B.default.weight"))
        by_hand = w + (8 / 4) * (b @ a)
        torch.testing.assert_close(merged[f"{layer}.weight"], by_hand, atol=1e-6, rtol=0)
        assert not torch.equal(merged[f"{layer}.weight"], w)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(merged[name], state[name])


def generate(engine):
    answer = asyncio.run(engine.generate(PROMPT, GREEDY, return_logprob=True))
    return answer["output_ids"], [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]


def test_an_adapter_sync_leaves_the_engine_as_a_merged_sync_does(tiny_model_dir):
    """Two backends trained alike, one syncing merged weights, the other adapters: after every push both engines
    hold the same weights bit for bit (the second push merges into the base again, it does not add up) and
    generate the same tokens greedily; the adapters are a small fraction of the bytes."""
    merged_backend = TorchBackend(lr=1e-2, lora=LORA)
    adapter_backend = TorchBackend(lr=1e-2, lora={**LORA, "sync": "adapters"})
    engines, planes = [], []
    for backend in (merged_backend, adapter_backend):
        backend.setup(str(tiny_model_dir), seed=0)
        engine = LocalEngine()
        engine.load_model(str(tiny_model_dir))
        engines.append(engine)
        planes.append(RolloutPlane(local_engines=[engine]))
    transport = InProcessTransport()
    untrained = generate(engines[0])
    for version in (1, 2):
        batch = make_train_batch(seed=version, rows=9)
        merged_backend.train_step(batch, ppo_clip)
        adapter_backend.train_step(batch, ppo_clip)
        payload = adapter_backend.export_weights()
        assert len(payload) == 42 and all(k.endswith((".lora_A.weight", ".lora_B.weight", ".lora_scaling"))
                                          for k in payload)
        sent = [transport.push(b, p, version) for b, p in ((merged_backend, planes[0]), (adapter_backend, planes[1]))]
        assert sent[1] * 10 < sent[0]
        one, two = (engine.model.state_dict() for engine in engines)
        assert all(torch.equal(one[name], two[name]) for name in one)
        assert engines[1].weight_version == version
        assert generate(engines[0]) == generate(engines[1])
    assert generate(engines[1]) != untrained  # the adapters changed what the engine generates

    # an adapter payload that does not fit is refused whole: nothing changes
    bad = {k: (v[:2] if k.endswith("lora_A.weight") and ".layers.1." in k else v) for k, v in payload.items()}
    with pytest.raises(ValueError, match=r"adapter update refused, nothing was applied.*layers\.1\..*does not give"):
        engines[1].update_weights(bad, 3)
    assert all(torch.equal(t, two[name]) for name, t in engines[1].model.state_dict().items())
    # full weights make a new base: an adapter payload merges into those
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    engines[1].update_weights(base, 3)
    engines[1].update_weights(payload, 4)
    assert all(torch.equal(t, two[name]) for name, t in engines[1].model.state_dict().items())
    for plane in planes:
        plane.close()


def _post(url, path, body):
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.fixture
def served_engine(tiny_model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(tmp_path / "engine.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "miles", "engine", "serve", "--model", str(tiny_model_dir),
                                 "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (tmp_path / "engine.log").read_text()
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            assert time.monotonic() < deadline, "the engine server did not answer /health"
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_adapters_reach_a_served_engine_over_tensor_and_shm(tiny_model_dir, served_engine):
    """The HTTP weight endpoints take adapter payloads as the transports send them: the served engine then
    generates what an in-process engine given the merged weights generates (tokens and log-probs)."""
    merged_backend = trained_backend(tiny_model_dir)
    adapter_backend = trained_backend(tiny_model_dir, sync="adapters")
    local = LocalEngine()
    local.load_model(str(tiny_model_dir))
    local.update_weights(merged_backend.export_weights(), 1)
    expected = generate(local)
    local.close()
    plane = RolloutPlane(router=Router([served_engine], health_interval_s=3600))
    shm = SharedMemoryTransport()
    try:
        for version, transport in ((1, TensorTransport()), (2, shm)):
            assert transport.push(adapter_backend, plane, version) < 100_000
            answer = _post(served_engine, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY,
                                                        "return_logprob": True})
            assert str(answer["meta_info"]["weight_version"]) == str(version)
            assert answer["output_ids"] == expected[0]
            logprobs = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
            assert logprobs == pytest.approx(expected[1], abs=1e-6)
    finally:
        shm.close()
        plane.close()


def test_a_checkpoint_holds_the_adapters_and_resumes_exactly(tiny_model_dir, tmp_path):
    """With dropout on the adapters (the RNG state matters): the step after load_checkpoint repeats the
    uninterrupted one bit for bit."""
    backend = trained_backend(tiny_model_dir, steps=1, dropout=0.1)
    backend.save_checkpoint(str(tmp_path / "ckpt"))
    assert sorted(p.name for p in (tmp_path / "ckpt" / "model").iterdir()) == ["adapters.safetensors"]
    saved = load_file(tmp_path / "ckpt" / "model" / "adapters.safetensors")
    assert len(saved) == 28 and all(is_adapter(name) for name in saved)
    assert len(torch.load(tmp_path / "ckpt" / "trainer.pt", weights_only=False)["optimizer"]["state"]) == 28
    batch = make_train_batch(seed=5, rows=9)
    expected = backend.train_step(batch, ppo_clip), backend.export_weights()

    resumed = TorchBackend(lr=1e-2, lora={**LORA, "dropout": 0.1})
    resumed.setup(str(tiny_model_dir), seed=123)  # other adapters at first: the checkpoint's replace them
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got = resumed.train_step(batch, ppo_clip), resumed.export_weights()
    assert got[0] == expected[0]
    assert all(torch.equal(got[1][name], expected[1][name]) for name in expected[1])

    full = TorchBackend(lr=1e-2)
    full.setup(str(tiny_model_dir), seed=0)
    with pytest.raises(ConfigError, match="holds LoRA adapters but this run has no backend.lora"):
        full.load_checkpoint(str(tmp_path / "ckpt"))
    other_rank = TorchBackend(lr=1e-2, lora={**LORA, "rank": 2})
    other_rank.setup(str(tiny_model_dir), seed=0)
    with pytest.raises(ConfigError, match="adapters do not fit backend.lora"):
        other_rank.load_checkpoint(str(tmp_path / "ckpt"))


def test_save_pretrained_writes_plain_hf_weights_with_the_adapters_merged(tiny_model_dir, tmp_path):
    backend = trained_backend(tiny_model_dir)
    backend.save_pretrained(str(tmp_path / "hf"), AutoTokenizer.from_pretrained(tiny_model_dir), {"step": 2})
    assert not (tmp_path / "hf" / "adapter_config.json").exists()
    assert not any("lora" in name or "base_layer" in name for name in load_file(tmp_path / "hf" / "model.safetensors"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()  # transformers alone, no peft
    ids = make_train_batch(seed=3, rows=6).input_ids
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, backend.model.eval()(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf") is not None


BASE = ["config", "configs/quickstart.yaml", "run.progress=false"]


@pytest.mark.parametrize(("overrides", "expected"), [
    (["backend.lora.rank=0"], "backend.lora.rank: expected an integer >= 1, got 0"),
    (["backend.lora.rank=4", "backend.lora.rnak=2"], "backend.lora.rnak: unknown key (known: rank, alpha, "
                                                     "target_modules, dropout, sync); did you mean 'rank'?"),
    (["backend.lora.alpha=2"], "backend.lora.rank: missing"),
    (["backend.lora.rank=4", "backend.lora.sync=both"], "backend.lora.sync: expected merged"),
    (["backend.lora.rank=4", "backend.lora.dropout=1.5"], "backend.lora.dropout: expected a number within [0, 1)"),
    (["backend.lora=8"], "backend.lora: expected a mapping"),
    (["--check", "backend.lora.rank=4", "backend.lora.target_modules=[q_prj]"],  # the model's modules: --check
     "backend.lora.target_modules: ['q_prj'] does not fit this model"),
    (["backend.lora.rank=4", "backend.lora.sync=adapters", "rollout.engine.num_engines=1",
      "rollout.engine.release_memory_during_train=true"],
     "backend.lora.sync: adapters merges into base weights the engine keeps"),
])
def test_bad_lora_configs_exit_2_naming_the_key(capsys, tmp_path, overrides, expected):
    code = main([*BASE, f"run.dir={tmp_path / 'run'}", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected in err and "Traceback" not in err


def test_lora_on_a_model_built_at_random_warns_at_start_and_on_a_trained_one_does_not(capsys, tmp_path,
                                                                                     tiny_model_dir):
    assert main([*BASE, f"run.dir={tmp_path / 'a'}", "backend.lora.rank=4"]) == 0
    err = capsys.readouterr().err
    assert "backend.lora: warning: the model is built at random (model.build, no model.path)" in err, err
    assert "from the SFT warm-up on" in err and "model.path=runs/sft/sft_model sft.steps=0" in err
    assert main([*BASE, f"run.dir={tmp_path / 'b'}", "backend.lora.rank=4", f"model.path={tiny_model_dir}",
                 "sft.steps=0"]) == 0
    assert "backend.lora: warning" not in capsys.readouterr().err


def test_adapter_sync_to_sglang_servers_is_refused(capsys, tmp_path):
    pytest.importorskip("miles_sglang")
    code = main([*BASE, f"run.dir={tmp_path / 'run'}", "backend.lora.rank=4", "backend.lora.sync=adapters",
                 "rollout.engine.name=sglang", "rollout.engine.num_engines=1"])
    err = capsys.readouterr().err
    assert code == 2 and "rollout.engine 'sglang' cannot take them" in err and "backend.lora.sync=merged" in err


def test_without_peft_lora_is_refused_naming_the_extra(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError, as where it is not installed
    code = main([*BASE, f"run.dir={tmp_path / 'run'}", "backend.lora.rank=4"])
    err = capsys.readouterr().err
    assert code == 2 and "backend.lora needs peft" in err and "pip install 'miles[lora]'" in err


@pytest.mark.slow
def test_a_short_quickstart_with_lora_trains_syncs_adapters_and_resumes(miles_cli, tmp_path):
    args = ["train", "configs/quickstart.yaml", f"run.dir={tmp_path}", "backend.lora.rank=8", "backend.lora.alpha=16",
            "backend.lora.sync=adapters", "sft.steps=20", "run.save_every=2", "run.progress=false"]
    result = miles_cli(*args, "run.steps=4")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = miles_cli(*args, "run.steps=6", "run.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward/mean" in row]
    assert [row["step"] for row in steps] == list(range(6))
    assert [row["weight_version"] for row in steps] == list(range(1, 7))  # one adapter sync per step
    for row in steps:
        assert {"reward/mean", "train/loss", "train/grad_norm", "time/weight_sync_s"} <= set(row)
        # the engine, merging the adapters it gets, holds the trainer's weights: their log-probs agree
        assert row["train/rollout_logprob_abs_diff"] < 1e-4
    assert any(row["train/grad_norm"] > 0 for row in steps)
    kept = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert kept and kept[-1].name == "step_000006"
    for checkpoint in kept:
        assert [p.name for p in (checkpoint / "backend" / "model").iterdir()] == ["adapters.safetensors"]
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final_model")
    assert not any("lora" in name for name in final.state_dict())


class TestTorchBackendWithLora(BackendConformance):
    """The backend contract holds with LoRA (merged sync): HF names and shapes, save_pretrained equal to the
    export, same seed same step, packings, resume."""
    split_options = ({"micro_batch_size": 6}, {"max_tokens_per_micro_batch": 14})
    resume_tolerance = 0.0

    def make_backend(self, **split):
        return TorchBackend(lr=1e-2, lora=LORA, **split)
