"""Where a run's processes go, and whether the machine can hold them (miles.run.placement): ``miles config
--check`` and ``miles train`` refuse, naming the key, a GPU config this CPU machine cannot run, before anything
starts; ``--target cluster.yaml`` checks it against a declared cluster and prints the placement."""

import importlib.util

import pytest
import yaml

from miles.cli import main

MODEL = {"build": {"arch": "qwen3", "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                   "head_dim": 16, "intermediate_size": 256, "max_position_embeddings": 64},
         "tokenizer": {"kind": "char", "alphabet": "0123456789+="}}


def _config(tmp_path, engine, backend, weight_sync="auto", name="run.yaml", prompts_per_step=4):
    config = {"model": MODEL, "data": {"generator": {"name": "addition", "max_operand": 9}},
              "rollout": {"engine": engine, "weight_sync": weight_sync, "prompts_per_step": prompts_per_step,
                          "n_samples": 2},
              "reward": {"name": "exact_match"}, "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"},
              "backend": backend, "sft": {"steps": 0}, "run": {"steps": 2, "dir": str(tmp_path / "run")}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _cluster(tmp_path, *groups, name="cluster.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"nodes": list(groups)}))
    return str(path)


SGLANG = {"name": "sglang", "num_engines": 2, "tp_size": 2}
FSDP2_GPU = {"name": "fsdp2", "world_size": 4, "device": "cuda"}


def test_a_gpu_config_this_machine_cannot_run_is_refused_naming_what_is_missing(tmp_path, capsys):
    """The first hour's case: SGLang engines at TP 2, FSDP2 on four GPU workers, the tensor transport. Each
    problem is named with its key, and `miles train` says it at once (no Ray placement waited on), leaving no run
    directory."""
    config = _config(tmp_path, SGLANG, FSDP2_GPU, weight_sync="tensor")
    assert main(["config", config, "--check"]) == 2
    assert "rollout.weight_sync: 'tensor' cannot update SGLang servers" in capsys.readouterr().err
    config = _config(tmp_path, SGLANG, FSDP2_GPU)
    if importlib.util.find_spec("sglang") is None:
        assert main(["config", config, "--check"]) == 2
        assert "rollout.engine: sglang needs sglang (pip install" in capsys.readouterr().err
    config = _config(tmp_path, {"name": "local", "num_engines": 2, "device": "cuda"}, FSDP2_GPU)
    assert main(["config", config, "--check"]) == 2
    err = capsys.readouterr().err
    assert "rollout.engine.device: engine (local) needs 1 GPU(s) and this machine has none" in err, err
    assert "2 x engine (local), 1 GPU(s) each (rollout.engine.device); 4 x trainer worker (fsdp2)" in err
    assert main(["train", config]) == 2
    assert "this machine has none" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_declared_cluster_gets_the_placement_printed(tmp_path, capsys):
    """8 GPUs of 80 GiB: two engines of one GPU each, then four FSDP2 workers; each kind's memory estimate."""
    config = _config(tmp_path, {"name": "local", "num_engines": 2, "device": "cuda"}, FSDP2_GPU)
    target = _cluster(tmp_path, {"count": 1, "gpus": 8, "gpu_memory_gib": 80, "gpu_model": "H100"})
    assert main(["config", config, "--target", target]) == 0
    err = capsys.readouterr().err
    table = err[err.index("placement on"):].splitlines()
    assert table[0] == f"placement on {target} (1 node(s), 8 GPU(s)):"
    rows = [" ".join(line.split()) for line in table[1:7]]
    assert rows == ["engine (local) 0 node 0, GPU 0", "engine (local) 1 node 0, GPU 1",
                    *(f"trainer worker (fsdp2) {i} node 0, GPU {i + 2}" for i in range(4))]
    assert "each trainer worker (fsdp2): " in err and "(16 B a parameter, 1/4 each)" in err
    assert not (tmp_path / "run").exists()


def test_engines_are_packed_one_node_each_at_a_large_tensor_parallel_size(tmp_path, capsys):
    """64 GPUs in 8 nodes: four SGLang engines at TP 8 (each on a node of its own), then 32 FSDP2 workers on the
    other four (checked against the declaration: SGLang need not be installed here)."""
    config = _config(tmp_path, {**SGLANG, "num_engines": 4, "tp_size": 8}, {**FSDP2_GPU, "world_size": 32},
                     prompts_per_step=32)
    target = _cluster(tmp_path, {"count": 8, "gpus": 8, "gpu_memory_gib": 80})
    assert main(["config", config, "--target", target]) == 0
    err = capsys.readouterr().err
    assert "(8 node(s), 64 GPU(s))" in err
    rows = [" ".join(line.split()) for line in err.splitlines() if line.startswith("  ") and ", GPU " in line]
    assert rows[:4] == [f"engine (sglang) {i} node {i}, GPU 0,1,2,3,4,5,6,7" for i in range(4)]
    assert rows[4] == "trainer worker (fsdp2) 0 node 4, GPU 0" and rows[-1] == "trainer worker (fsdp2) 31 node 7, GPU 7"
    assert "each engine (sglang): " in err and "(bf16, 1/8 each)" in err


@pytest.mark.parametrize("engine, backend, cluster, message", [
    ({"name": "local", "num_engines": 4, "device": "cuda"}, FSDP2_GPU, {"count": 1, "gpus": 6, "gpu_memory_gib": 80},
     "backend.device: 4 x trainer worker (fsdp2) at 1 GPU(s) each do not fit {target}: the run asks 8 GPUs and "
     "{target} has 6"),
    ({"name": "local", "num_engines": 1, "device": "cuda"}, FSDP2_GPU,
     {"count": 1, "gpus": 8, "gpu_memory_gib": 0.0001}, "rollout.engine.device: each engine (local) plans 0.000"),
    ({"name": "local", "num_engines": 1, "device": "cpu"}, FSDP2_GPU, {"count": 2, "gpus": 2, "gpu_memory_gib": 0.005},
     "backend.device: each trainer worker (fsdp2) plans 0.02"),
])
def test_a_run_the_cluster_cannot_hold_is_refused_with_the_numbers(tmp_path, capsys, engine, backend, cluster,
                                                                   message):
    target = _cluster(tmp_path, cluster)
    assert main(["config", _config(tmp_path, engine, backend), "--target", target]) == 2
    err = capsys.readouterr().err
    assert message.format(target=target) in err, err
    assert "GiB" in err or "GPUs" in err


def test_an_in_process_engine_and_trainer_share_the_run_s_gpu(tmp_path, capsys):
    config = _config(tmp_path, {"name": "local", "device": "cuda"}, {"name": "torch", "device": "cuda"})
    target = _cluster(tmp_path, {"count": 1, "gpus": 1, "gpu_memory_gib": 24})
    assert main(["config", config, "--target", target]) == 0
    rows = [" ".join(line.split()) for line in capsys.readouterr().err.splitlines() if "node 0, GPU" in line]
    assert rows == ["engine (local, in process) 0 node 0, GPU 0", "trainer (torch) 0 node 0, GPU 0"]


@pytest.mark.parametrize("declared, message", [
    ({"nodes": []}, "expected a mapping with a list 'nodes'"),
    ({"nodes": [{"gpus": 8}]}, r"nodes\[0\].gpu_memory_gib: expected each GPU's memory in GiB"),
    ({"nodes": [{"count": 0, "gpus": 8, "gpu_memory_gib": 80}]}, r"nodes\[0\].count: expected a whole number >= 1"),
    ({"nodes": [{"gpus": 8, "gpu_memory_gib": 80, "memory": 1}]}, r"nodes\[0\]: expected \{count, gpus"),
])
def test_a_bad_cluster_declaration_is_refused_naming_the_field(tmp_path, capsys, declared, message):
    import re

    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(declared))
    config = _config(tmp_path, {"name": "local"}, {"name": "torch"})
    assert main(["config", config, "--target", str(tmp_path / "bad.yaml")]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_cpu_run_passes_and_prints_no_placement(tmp_path, capsys):
    assert main(["config", "configs/quickstart.yaml", "--check", f"run.dir={tmp_path / 'run'}"]) == 0
    assert "placement on" not in capsys.readouterr().err
