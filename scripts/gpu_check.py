"""The checks of scripts/gpu_check.sh: each runs in a process of its own under a time budget, so that one
that hangs or crashes the CUDA context still leaves a JSON summary of the others.

    python scripts/gpu_check.py [--dry-run] [--out FILE]      # all checks, one JSON summary on stdout
    python scripts/gpu_check.py --check NAME [--dry-run]      # one check, its JSON on the last line

``--dry-run`` runs every check on CPU with tiny sizes: the same code paths, so the script is known to
work before a GPU is at hand (tests/test_gpu_check.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A random-init Qwen3 of about 0.5B parameters (the char tokenizer's vocabulary is tiny: nearly all of them
# are in the 32 decoder layers), and the tiny shape of the dry run.
QWEN3_05B = {"hidden_size": 1024, "num_layers": 32, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128,
             "intermediate_size": 3072, "max_position_embeddings": 2048}
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "max_position_embeddings": 256}

# check -> (seconds allowed on a GPU, in the dry run): 940 s on a GPU in all (checks rarely use their whole budget);
# where one command may take 10 minutes, run them in two: --only ... sglang_run and --only precision sglang_precision
# speculative sglang_speculative.
CHECKS = {
    "environment": (20, 60),
    "quickstart": (60, 180),
    "engine_decode": (45, 60),
    "train_throughput": (45, 60),
    "weight_sync": (45, 90),
    "megatron_conformance": (75, 120),
    "logprob_kernels": (30, 60),
    "sglang_run": (150, 30),
    "precision": (60, 150),
    "sglang_precision": (200, 30),
    "speculative": (60, 60),
    "sglang_speculative": (150, 30),
}


def _device(dry: bool) -> str:
    return "cpu" if dry else "cuda"


def _model(tmp: Path, dry: bool) -> tuple[Path, int]:
    import torch

    from miles.testing import build_tiny_model

    path = build_tiny_model(tmp / "model", **(TINY if dry else QWEN3_05B))
    from safetensors.torch import load_file

    params = sum(t.numel() for f in path.glob("*.safetensors") for t in load_file(f).values())
    torch.manual_seed(0)
    return path, params


def check_environment(dry: bool, tmp: Path) -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), bf16=torch.cuda.is_bf16_supported(),
                    gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    elif not dry:
        raise RuntimeError("torch sees no GPU")
    for package in ("megatron.core", "sglang", "transformers", "ray"):
        try:
            module = __import__(package, fromlist=["__version__"])
            info[package] = getattr(module, "__version__", "installed")
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            info[package] = f"missing ({type(exc).__name__})"
    return info


def check_quickstart(dry: bool, tmp: Path) -> dict:
    """The quickstart recipe on this device (bf16 autocast on a GPU): does the reward rise."""
    from miles.run.runner import prepare, train

    steps = 4 if dry else 60
    overrides = [f"run.dir={tmp / 'run'}", "run.progress=false", f"run.steps={steps}", "run.eval_size=0",
                 f"backend.device={_device(dry)}", f"backend.dtype={'float32' if dry else 'bfloat16'}",
                 f"rollout.engine.device={_device(dry)}", *(["sft.steps=5"] if dry else [])]
    start = time.perf_counter()
    train(prepare(str(ROOT / "configs/quickstart.yaml"), overrides))
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    k = max(1, len(rewards) // 4)
    return {"steps": len(rows), "seconds": round(time.perf_counter() - start, 1),
            "reward_first": round(sum(rewards[:k]) / k, 3), "reward_last": round(sum(rewards[-k:]) / k, 3),
            "step_ms": round(1000 * sum(r["time/step_s"] for r in rows) / len(rows), 1)}


def check_engine_decode(dry: bool, tmp: Path) -> dict:
    """Decode tokens/s of the embedded engine: a batch of requests generating a fixed number of tokens."""
    import asyncio

    from miles.engine import LocalEngine

    path, params = _model(tmp, dry)
    batch, new_tokens = (4, 8) if dry else (64, 256)
    engine = LocalEngine(device=_device(dry), dtype="float32" if dry else "bfloat16", max_batch_size=batch)
    engine.load_model(str(path))
    sampling = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}

    async def run() -> int:
        answers = await asyncio.gather(*(engine.generate([1, 2, 3, 4], sampling) for _ in range(batch)))
        return sum(len(a["output_ids"]) for a in answers)

    asyncio.run(run())  # warm-up
    start = time.perf_counter()
    tokens = asyncio.run(run())
    seconds = time.perf_counter() - start
    engine.close()
    return {"params_m": round(params / 1e6, 1), "batch": batch, "tokens": tokens,
            "decode_tokens_per_s": round(tokens / seconds, 1)}


def check_train_throughput(dry: bool, tmp: Path) -> dict:
    """Training tokens/s of the torch backend (forward, backward, AdamW) on one GRPO-shaped batch."""
    import torch

    from miles.builtin.advantages import grpo
    from miles.train.losses import ppo_clip
    from miles.train.torch_backend import TorchBackend
    from miles.types import Sample, SampleStatus, TrainBatch

    path, params = _model(tmp, dry)
    rows, length = (4, 16) if dry else (16, 1024)
    backend = TorchBackend(lr=1e-5, device=_device(dry), dtype="float32" if dry else "bfloat16",
                           micro_batch_size=rows if dry else 4)
    backend.setup(str(path), seed=0)
    gen = torch.Generator().manual_seed(0)
    response = length - 4
    samples = [Sample(prompt_ids=[4, 13, 5, 14], group_index=i // 2, status=SampleStatus.COMPLETED,
                      response_ids=torch.randint(3, 12, (response,), generator=gen).tolist(), loss_mask=[1] * response,
                      rollout_logprobs=[-2.0] * response, reward=float(i % 2)) for i in range(rows)]
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.advantages = grpo(batch)
    backend.train_step(batch, ppo_clip)  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start, steps = time.perf_counter(), 1 if dry else 3
    for _ in range(steps):
        backend.train_step(batch, ppo_clip)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    backend.shutdown()
    return {"params_m": round(params / 1e6, 1), "tokens_per_step": rows * length,
            "train_tokens_per_s": round(rows * length / seconds, 1), "step_s": round(seconds, 3)}


def check_weight_sync(dry: bool, tmp: Path) -> dict:
    """Push the model's weights to a `miles engine serve` process with each transport; seconds per push."""

    from miles.rollout.plane import RolloutPlane
    from miles.engine.router import Router
    from miles.testing import serve_engine
    from miles.train.torch_backend import TorchBackend
    from miles.weights.transports import DistributedTransport, SharedMemoryTransport, TensorTransport

    path, params = _model(tmp, dry)
    backend = TorchBackend(device=_device(dry))
    backend.setup(str(path), seed=0)
    out = {"params_m": round(params / 1e6, 1)}
    with serve_engine(path, "--device", _device(dry)) as url:
        plane = RolloutPlane(router=Router([url]))
        plane.run(plane.router.wait_healthy(timeout_s=60))
        for name, transport in (("tensor", TensorTransport()), ("shm", SharedMemoryTransport()),
                                ("distributed_gloo", DistributedTransport())):
            transport.push(backend, plane, 1)  # the first push sets up (group, file)
            start = time.perf_counter()
            pushed = transport.push(backend, plane, 2)
            out[f"{name}_s"] = round(time.perf_counter() - start, 3)
            out[f"{name}_mb"] = round(pushed / 1e6, 3)
            if hasattr(transport, "close"):
                transport.close()
        plane.close()
    out["nccl"] = ("not measured: Miles' distributed transport uses gloo; NCCL broadcast needs a second GPU "
                   "(NCCL refuses two ranks on one device)")
    backend.shutdown()
    return out


def check_megatron_conformance(dry: bool, tmp: Path) -> dict:
    """miles-megatron's conformance tests on this device."""
    plugin = ROOT / "plugins" / "miles-megatron"
    if not plugin.exists():
        return {"skipped": "plugins/miles-megatron is not in this checkout"}
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"megatron-core is not installed ({exc})"}
    env = {**os.environ, "MILES_TEST_DEVICE": _device(dry)}
    # The dry run takes one quick test of the plugin, through the same pytest call (its own tests run the
    # conformance suite on CPU).
    select = "test_the_backend_is_registered_as_megatron" if dry else "Conformance"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                             str(plugin / "tests"), "-k", select], capture_output=True, text=True, env=env, cwd=ROOT)
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    if result.returncode != 0:
        raise RuntimeError(f"pytest exit {result.returncode}: {summary}\n"
                           f"{result.stdout[-2000:]}{result.stderr[-1000:]}")
    return {"pytest": summary}


def check_logprob_kernels(dry: bool, tmp: Path) -> dict:
    """miles-kernels' triton log-prob kernel against the torch reference (forward, backward, the chunked log-prob
    path on a tiny model), and both kernels' time on one [4096 x 151936] chunk. The dry run takes Triton's
    interpreter on CPU tensors."""
    plugin = ROOT / "plugins" / "miles-kernels"
    if not plugin.exists():
        return {"skipped": "plugins/miles-kernels is not in this checkout"}
    try:
        import triton
    except ImportError as exc:
        return {"skipped": f"triton is not installed ({exc})"}
    # The plugin from the checkout, installed or not.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p)}
    if dry:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-m", "miles_kernels.reference_check", "--device", _device(dry)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"reference_check exit {done.returncode}: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result.pop("ok"):
        raise RuntimeError(f"the triton kernel differs from the torch reference: {json.dumps(result)[:1500]}")
    return {"triton": triton.__version__, **result}


def check_sglang_run(dry: bool, tmp: Path) -> dict:
    """A short quickstart run with real SGLang engines (miles-sglang), when sglang is installed."""
    try:
        import sglang  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"sglang is not installed ({exc})"}
    from miles.run.runner import prepare, train

    overrides = [f"run.dir={tmp / 'run'}", "run.progress=false", "run.steps=3", "run.eval_size=0", "sft.steps=5",
                 "rollout.engine.name=sglang", "rollout.engine.num_engines=1", f"backend.device={_device(dry)}"]
    start = time.perf_counter()
    train(prepare(str(ROOT / "configs/quickstart.yaml"), overrides))
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"steps": len(rows), "seconds": round(time.perf_counter() - start, 1),
            "weight_versions": [r["weight_version"] for r in rows]}


def check_precision(dry: bool, tmp: Path) -> dict:
    """Low precision on this device (docs/precision.md): short quickstart runs with an FP8 and an INT4 rollout engine
    (the embedded engine holding the stored form), INT4 with QAT, and MXFP8 training; each run's push bytes against
    bf16's and its engine/trainer mismatch. On a GPU it also says whether torchao's MX and FP8 kernels are there
    (what backend.precision would use for speed; the numerics here are the emulation)."""
    import torch

    from miles.run.runner import prepare, train

    variants = {"fp8_block_rollout": ["rollout.precision=fp8_block"],
                "int4_rollout": ["rollout.precision=int4_w4a16"],
                "int4_rollout_qat": ["rollout.precision=int4_w4a16", "backend.qat=int4_w4a16"],
                "mxfp8_training": ["backend.precision=mxfp8"]}
    out: dict = {}
    for name, extra in variants.items():
        run_dir = tmp / name
        overrides = [f"run.dir={run_dir}", "run.progress=false", f"run.steps={3 if dry else 10}", "run.eval_size=0",
                     "sft.steps=5", f"backend.device={_device(dry)}", f"rollout.engine.device={_device(dry)}", *extra]
        start = time.perf_counter()
        train(prepare(str(ROOT / "configs/quickstart.yaml"), overrides))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        out[name] = {"steps": len(rows), "seconds": round(time.perf_counter() - start, 1),
                     "logprob_abs_diff": max(r["train/rollout_logprob_abs_diff"] for r in rows),
                     "push_vs_bf16": round(rows[-1]["weight_sync/stored_bytes"] / rows[-1]["weight_sync/bf16_bytes"],
                                           3) if "weight_sync/stored_bytes" in rows[-1] else None}
    if out["int4_rollout_qat"]["logprob_abs_diff"] * 5 > out["int4_rollout"]["logprob_abs_diff"]:
        raise RuntimeError(f"QAT did not cut the INT4 mismatch 5x: {out}")
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(0)
        out["kernels"] = {"compute_capability": f"{capability[0]}.{capability[1]}",
                          "fp8_tensor_cores": capability >= (8, 9), "mx_tensor_cores": capability >= (10, 0)}
    import torchao

    out["torchao"] = torchao.__version__
    return out


def check_sglang_precision(dry: bool, tmp: Path) -> dict:
    """Short quickstart runs with SGLang engines in FP8 (block) and INT4 (compressed-tensors): the server starts on
    the stored form with --quantization fp8 / compressed-tensors, and each push reaches it (on disk) in that form."""
    try:
        import sglang  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"sglang is not installed ({exc})"}
    from miles.run.runner import prepare, train

    out: dict = {}
    for scheme in ("fp8_block", "int4_w4a16"):
        run_dir = tmp / scheme
        overrides = [f"run.dir={run_dir}", "run.progress=false", "run.steps=3", "run.eval_size=0", "sft.steps=5",
                     "rollout.engine.name=sglang", "rollout.engine.num_engines=1", f"backend.device={_device(dry)}",
                     f"rollout.precision={scheme}"]
        start = time.perf_counter()
        train(prepare(str(ROOT / "configs/quickstart.yaml"), overrides))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        out[scheme] = {"steps": len(rows), "seconds": round(time.perf_counter() - start, 1),
                       "weight_versions": [r["weight_version"] for r in rows],
                       "logprob_abs_diff": max(r["train/rollout_logprob_abs_diff"] for r in rows)}
    return out


def check_speculative(dry: bool, tmp: Path) -> dict:
    """The embedded engine with a draft (rollout.engine.speculative) on the GPU: greedy decoding gives plain
    decoding's tokens, the log-probs are the target's (float32: the same sums, ordered otherwise), and the tokens/s
    of one row, plain and speculative; the same with an MTP head (draft: mtp, built at random: the target's hidden
    states and its output layer on CUDA). The models are random: the draft is the target's first layers (its
    agreement is what a trained draft's would be, not a figure to quote)."""
    import asyncio

    import torch

    from miles.engine import LocalEngine
    from miles.models.hf import load_model, load_tokenizer, save_pretrained

    path, params = _model(tmp, dry)
    target = load_model(path)
    draft = load_model(path)
    draft.model.layers = draft.model.layers[:2]
    draft.config.layer_types, draft.config.num_hidden_layers = draft.config.layer_types[:2], 2
    save_pretrained(draft, load_tokenizer(path), tmp / "draft")
    del target, draft
    new_tokens = 16 if dry else 128
    sampling = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    out: dict = {"params_m": round(params / 1e6, 1)}
    answers = {}
    for name, spec in (("plain", None), ("speculative", {"draft": {"path": str(tmp / "draft")}, "num_tokens": 4,
                                                         "when": "always", "force": True}),
                       ("mtp", {"draft": "mtp", "num_tokens": 2, "when": "always", "force": True})):
        engine = LocalEngine(device=_device(dry), dtype="float32", speculative=spec)
        engine.load_model(str(path))
        asyncio.run(engine.generate([1, 2, 3, 4], sampling))  # warm-up
        if not dry:
            torch.cuda.synchronize()
        start = time.perf_counter()
        answers[name] = asyncio.run(engine.generate([1, 2, 3, 4], sampling))
        out[f"{name}_tokens_per_s"] = round(new_tokens / (time.perf_counter() - start), 1)
        if spec is not None:
            stats = engine.stats()
            out[f"{name}_kept"] = round(stats["spec_accepted"] / max(1, stats["spec_proposed"]), 3)
        engine.close()
    plain = answers["plain"]
    for name in ("speculative", "mtp"):
        spec = answers[name]
        assert plain["output_ids"] == spec["output_ids"], (name, plain["output_ids"], spec["output_ids"])
        gap = max(abs(a[0] - b[0]) for a, b in zip(plain["meta_info"]["output_token_logprobs"],
                                                    spec["meta_info"]["output_token_logprobs"]))
        out[f"{name}_logprob_abs_diff_max"] = gap
        assert gap < 1e-4, (name, gap)
    return out


def check_sglang_speculative(dry: bool, tmp: Path) -> dict:
    """SGLang with a draft model (STANDALONE, rollout.engine.speculative): the flags parse with the installed
    SGLang, a short quickstart run serves and takes its weight pushes with speculation on."""
    try:
        import sglang  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"sglang is not installed ({exc})"}
    from miles.run.runner import prepare, train
    from miles.testing import build_tiny_model

    draft = build_tiny_model(tmp / "draft", alphabet="0123456789+=", hidden_size=32, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=32)
    overrides = [f"run.dir={tmp / 'run'}", "run.progress=false", "run.steps=3", "run.eval_size=0", "sft.steps=5",
                 "rollout.engine.name=sglang", "rollout.engine.num_engines=1", f"backend.device={_device(dry)}",
                 f"rollout.engine.speculative={{draft: {{path: {draft}}}, num_tokens: 3, when: always}}"]
    start = time.perf_counter()
    train(prepare(str(ROOT / "configs/quickstart.yaml"), overrides))
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"steps": len(rows), "seconds": round(time.perf_counter() - start, 1),
            "weight_versions": [r["weight_version"] for r in rows]}


def run_one(name: str, dry: bool) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if dry:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix=f"miles-gpu-check-{name}-") as tmp:
        start = time.perf_counter()
        result = globals()[f"check_{name}"](dry, Path(tmp))
    status = "skipped" if "skipped" in result else "ok"
    return {"status": status, "seconds": round(time.perf_counter() - start, 1), **result}


def run_all(dry: bool, only: list[str]) -> dict:
    summary = {"dry_run": dry, "checks": {}}
    for name in only:
        budget = CHECKS[name][1 if dry else 0]
        cmd = [sys.executable, __file__, "--check", name, *(["--dry-run"] if dry else [])]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=budget, cwd=ROOT)
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stderr or b"")[-1500:]
            summary["checks"][name] = {"status": "timeout", "budget_s": budget,
                                       "stderr_tail": (tail.decode(errors="replace") if isinstance(tail, bytes)
                                                       else tail)}
            continue
        last = (done.stdout.strip().splitlines() or [""])[-1]
        try:
            summary["checks"][name] = json.loads(last)
        except json.JSONDecodeError:
            summary["checks"][name] = {"status": "failed", "exit_code": done.returncode,
                                       "stderr_tail": done.stderr[-1500:]}
    summary["ok"] = all(c["status"] in ("ok", "skipped") for c in summary["checks"].values())
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU and tiny sizes: the same code paths")
    parser.add_argument("--check", choices=list(CHECKS), help="run one check in this process")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    parser.add_argument("--out", help="also write the summary to this file")
    args = parser.parse_args()
    if args.check:
        try:
            result = run_one(args.check, args.dry_run)
        except Exception as exc:  # noqa: BLE001 - the summary says what failed
            import traceback

            traceback.print_exc()
            result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(json.dumps(result))
        return 0
    summary = run_all(args.dry_run, args.only)
    text = json.dumps(summary, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
