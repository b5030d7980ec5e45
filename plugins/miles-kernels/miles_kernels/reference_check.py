"""The numerical check of the ``triton`` kernel against Miles' ``torch`` kernel (the reference), and of the
chunked log-prob path with it against the whole path, on a tiny random-init Qwen3.

    python -m miles_kernels.reference_check --device cuda          # on a GPU
    TRITON_INTERPRET=1 python -m miles_kernels.reference_check      # on CPU, through Triton's interpreter

Prints one JSON object: the largest absolute difference of each figure per case, and ``ok``. The tests and
Miles' ``scripts/gpu_check.py`` run it.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from miles.train.api import TorchKernel, token_logprobs
from miles_kernels.kernel import TritonKernel, gpu_backend

# (rows, vocabulary, block): vocabularies that are and are not multiples of the block, one block and several.
SMALL = ((5, 37, 16), (3, 16, 16), (7, 100, 32), (1, 129, 64))
GPU = (*SMALL, (61, 32000, 1024), (256, 151936, 4096))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def kernel_case(rows: int, vocab: int, block: int, device: str, seed: int = 0) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(device)
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    grad_lp, grad_ent = torch.randn(2, rows, generator=gen).to(device)
    reference, triton = TorchKernel(), TritonKernel(block=block)
    want, got = reference.forward(logits, targets), triton.forward(logits.clone(), targets)
    out = {name: _max_diff(w, g) for name, w, g in zip(("logprobs", "entropy", "lse"), want, got)}
    lse, entropy = want[2], want[1]
    for name, ent in (("grad_logits", grad_ent), ("grad_logits_no_entropy", None)):
        expected = reference.backward(logits.clone(), targets, lse, entropy, grad_lp, ent)
        out[name] = _max_diff(expected, triton.backward(logits.clone(), targets, lse, entropy, grad_lp, ent))
    return out


def model_case(device: str, chunk_tokens: int = 5, block: int = 16) -> dict[str, float]:
    """log-probs, entropy and every parameter's gradient of a loss using both: chunked with the triton kernel
    against the whole path (tied embeddings, right-padded rows, a chunk size that does not divide the tokens)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=37, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 37, (3, 9), generator=gen)
    input_ids[1, 6:] = 0  # padding
    input_ids = input_ids.to(device)
    weights = torch.randn(3, 8, generator=gen).to(device)

    def run(**chunked: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logprobs, entropy = token_logprobs(model, input_ids, with_entropy=True, entropy_grad=True, **chunked)
        ((logprobs * weights).sum() + 0.1 * (entropy * weights.flip(0)).sum()).backward()
        return logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    whole, chunked = run(), run(chunk_tokens=chunk_tokens, kernel=TritonKernel(block=block))
    return {"logprobs": _max_diff(whole[0], chunked[0]), "entropy": _max_diff(whole[1], chunked[1]),
            "param_grads": max(_max_diff(whole[2][n], chunked[2][n]) for n in whole[2])}


def timing(device: str, rows: int = 4096, vocab: int = 151936, repeats: int = 5) -> dict[str, float]:
    """Forward plus backward of one [rows, vocab] chunk, median ms, each kernel (a GPU only)."""
    logits = torch.randn(rows, vocab, device=device)
    targets = torch.randint(0, vocab, (rows,), device=device)
    grad = torch.randn(rows, device=device)
    out = {}
    for name, kernel in (("torch", TorchKernel()), ("triton", TritonKernel())):
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            _, entropy, lse = kernel.forward(logits, targets)
            kernel.backward(logits.clone(), targets, lse, entropy, grad, grad)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[f"{name}_ms"] = round(1000 * sorted(times[1:])[len(times[1:]) // 2], 2)
    return out


def run(device: str, tolerance: float | None = None) -> dict[str, Any]:
    on_gpu = device.startswith("cuda")
    tolerance = tolerance if tolerance is not None else (1e-4 if on_gpu else 1e-5)
    reason = TritonKernel().unavailable(torch.device(device))
    if reason:
        return {"ok": False, "error": f"the triton kernel cannot run on {device}: {reason}"}
    cases = {f"rows={r} vocab={v} block={b}": kernel_case(r, v, b, device) for r, v, b in (GPU if on_gpu else SMALL)}
    cases["tiny qwen3, chunk 5"] = model_case(device)
    worst = max(value for case in cases.values() for value in case.values())
    out: dict[str, Any] = {"device": device, "backend": gpu_backend() if on_gpu else "interpreter",
                           "tolerance": tolerance, "max_abs_diff": worst, "ok": worst <= tolerance, "cases": cases}
    if on_gpu:
        out["chunk_4096x151936_fwd_bwd"] = timing(device)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tolerance", type=float)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(run(args.device, args.tolerance)))


if __name__ == "__main__":
    main()
