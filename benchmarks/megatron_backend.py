"""The Megatron backend (plugins/miles-megatron) on CPU: HF <-> Megatron conversion and train steps.

    python benchmarks/megatron_backend.py convert [--hidden 512 --layers 4 --vocab 32000]
    python benchmarks/megatron_backend.py step [--steps 10 --rows 128]

``convert``: a random-init Qwen3 (~30M parameters by default) converted HF -> Megatron -> HF in a
fresh process: the time of each direction, the peak memory above the loaded HF weights (VmHWM reset
before converting), and whether the round trip is bit-equal.
``step``: the quickstart's model, one batch of ``rows`` samples, ``steps`` optimizer steps each on
Miles' ``torch`` backend and on ``megatron`` (one worker; with and without sequence packing): the
median step time and the first step's loss.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def convert_child(weights_file: str, config_dir: str) -> None:
    """Runs in a fresh process: prints the conversion figures as JSON."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from miles_megatron.arch import model_spec
    from miles_megatron.convert import hf_to_megatron, megatron_to_hf, shard, unshard

    torch.set_num_threads(1)
    spec = model_spec(AutoConfig.from_pretrained(config_dir))
    hf = load_file(weights_file)
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"]  # tied, as in the in-memory state dict
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    base = _rss_kib("VmRSS")
    start = time.perf_counter()
    megatron = shard(hf_to_megatron(hf, spec), spec)
    to_megatron_s = time.perf_counter() - start
    start = time.perf_counter()
    back = megatron_to_hf(unshard({(0, 0): megatron}, spec), spec)
    to_hf_s = time.perf_counter() - start
    peak = _rss_kib("VmHWM")
    params = sum(t.numel() for k, t in hf.items() if k != "lm_head.weight")
    exact = set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    print(json.dumps({"parameters": params, "hf_to_megatron_s": to_megatron_s, "megatron_to_hf_s": to_hf_s,
                      "peak_above_loaded_mib": (peak - base) / 1024, "weights_mib": params * 4 / 2**20,
                      "bit_equal": exact}))


def convert(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
                         intermediate_size=3 * args.hidden, tie_word_embeddings=True, max_position_embeddings=512)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        config.save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
                  f"{tmp}/weights.safetensors")
        del model
        out = subprocess.run([sys.executable, __file__, "convert-child", f"{tmp}/weights.safetensors", tmp],
                             check=True, capture_output=True, text=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    print(f"Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
          f"{figures['parameters'] / 1e6:.1f}M parameters ({figures['weights_mib']:.0f} MiB float32)")
    print(f"  HF -> Megatron: {figures['hf_to_megatron_s']:.3f} s; Megatron -> HF: {figures['megatron_to_hf_s']:.3f} s")
    print(f"  peak memory above the loaded HF weights: {figures['peak_above_loaded_mib']:.0f} MiB")
    print(f"  round trip bit-equal: {figures['bit_equal']}")


def step(args: argparse.Namespace) -> None:
    import torch

    from miles.train.losses import ppo_clip
    from miles.testing import build_tiny_model, make_train_batch
    from miles.train.torch_backend import TorchBackend

    torch.set_num_threads(1)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    from miles_megatron import MegatronBackend

    with tempfile.TemporaryDirectory() as tmp:
        # The quickstart's model: Qwen3, hidden 64, 2 layers, 4 heads (2 KV heads), intermediate 256.
        model_dir = build_tiny_model(Path(tmp) / "model", max_position_embeddings=32)
        batch = make_train_batch(rows=args.rows, group_size=8)
        backends = {"torch": lambda: TorchBackend(lr=1e-3, micro_batch_size=128),
                    "megatron": lambda: MegatronBackend(lr=1e-3, micro_batch_size=128),
                    "megatron, sequence_packing": lambda: MegatronBackend(lr=1e-3, micro_batch_size=128,
                                                                          sequence_packing=True)}
        for name, make in backends.items():
            backend = make()
            backend.setup(str(model_dir), seed=0)
            times, losses = [], []
            for _ in range(args.steps):
                start = time.perf_counter()
                losses.append(backend.train_step(batch, ppo_clip)["train/loss"])
                times.append(time.perf_counter() - start)
            backend.shutdown()
            print(f"{name:28s} median step {statistics.median(times) * 1000:7.1f} ms "
                  f"(min {min(times) * 1000:.1f}), first-step loss {losses[0]:.6f}, last {losses[-1]:.6f}")
    ray.shutdown()


def main() -> None:
    if sys.argv[1:2] == ["convert-child"]:
        convert_child(*sys.argv[2:4])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("convert")
    c.add_argument("--hidden", type=int, default=512)
    c.add_argument("--layers", type=int, default=4)
    c.add_argument("--vocab", type=int, default=32000)
    s = sub.add_parser("step")
    s.add_argument("--steps", type=int, default=10)
    s.add_argument("--rows", type=int, default=128)
    args = parser.parse_args()
    convert(args) if args.what == "convert" else step(args)


if __name__ == "__main__":
    main()
