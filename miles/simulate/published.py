"""The published case the simulation is held against, and what each of its figures is.

Miles' ROCm post: Qwen3-30B-A3B, GRPO on one node of eight AMD Instinct MI300X, 32 prompts x 8 samples, an 8k
response cap, global batch 256, partial rollouts, SGLang and Megatron (TP4/EP8) colocated on the same GPUs. Mean step
388.50 s (steps 4-145): rollout 152.79 s, actor training 95.30 s, weight update 33.85 s, log-probs 31.53 s (the
four sum to 313.47 s; the post does not say what the other 75.03 s are). Rollout throughput "mostly 1.1k-1.3k tokens
per GPU per second", training "around 15-16k tokens per second"; on AIME, truncation fell from 0.294 to 0.156.

What the models take from it, and what they do not:

- The engine (:meth:`EngineModel.calibrated`): one SGLang engine over the eight GPUs (EP8, the post's layout) that
  decodes 1.3k tokens per GPU per second with a full batch (the top of the published range: a full batch is the
  engine's best), 256 rows at most (SGLang's largest CUDA-graph batch in the recipe). Not from the post: a single
  row decodes at 100 tokens per second (10 ms a step: the MoE's weights and its all-to-all; benchmarks/scale.py
  shows the prediction for 60 to 150), and the KV cache is read
  at the MI300X's 5.3 TB/s per GPU, 98,304 bytes per token (48 layers x 4 KV heads x 128 x K and V x bf16).
- The trainer: 15.5k tokens per second, the log-prob pass three times as fast (a forward of three units).
- The lengths: the post gives no training response lengths. Their mean follows from its training figures (95.30 s
  at 15.5k tokens per second is 1.48M tokens, 5.77k a sample with its 200-token prompt); their spread from the
  truncation it reports (0.22, the middle of its range): a log-normal with that mean and that truncation at 8,192.
  So the training time matches by construction; the rollout, the log-probs and the step are predicted.
- The weight update is taken as published (33.85 s): nothing in the post gives a bandwidth to predict it from.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from miles.simulate.cluster import Scenario, Trainer
from miles.simulate.engines import EngineModel, LengthModel

__all__ = ["PUBLISHED", "published_case", "qwen3_30b_engine", "published_lengths"]

PUBLISHED = {"step_s": 388.50, "rollout_s": 152.79, "train_s": 95.30, "update_s": 33.85, "logprob_s": 31.53}
GPUS = 8
CAP = 8192
PROMPT = 200
TRAIN_TOKENS_S = 15_500.0
TRUNCATED = 0.22


def qwen3_30b_engine(gpus: int = GPUS, single_row_tokens_s: float = 100.0) -> EngineModel:
    """One engine of ``gpus`` MI300X serving Qwen3-30B-A3B: 1.3k tokens per GPU per second with a full batch, a
    single row at ``single_row_tokens_s``, whatever its size."""
    return EngineModel.calibrated(tokens_per_gpu_s=1300.0, gpus=gpus, full_rows=256, full_context=PROMPT + 2900,
                                  single_row_tokens_s=single_row_tokens_s, kv_bytes_per_token=98_304,
                                  memory_bandwidth_gbs=5300.0)


def published_lengths(sigma: float | None = None) -> LengthModel:
    """Lengths averaging the post's 5.57k response tokens under the 8k cap; by default with the truncation it
    reports, or with log-normal ``sigma`` (a longer tail: larger)."""
    mean = PUBLISHED["train_s"] * TRAIN_TOKENS_S / 256 - PROMPT
    if sigma is not None:
        return LengthModel.with_mean(mean, sigma, CAP)
    lo, hi = 0.05, 3.0
    for _ in range(60):  # the spread whose truncation at the cap is the post's
        mid = (lo + hi) / 2
        if LengthModel.with_mean(mean, mid, CAP).truncated_frac(CAP) < TRUNCATED:
            lo = mid
        else:
            hi = mid
    return LengthModel.with_mean(mean, (lo + hi) / 2, CAP)


def published_case(**changes: Any) -> Scenario:
    """The post's run as a :class:`Scenario` (sync, colocated, partial rollouts); ``changes`` override fields."""
    base = Scenario(engines=1, engine=qwen3_30b_engine(), trainer=Trainer(TRAIN_TOKENS_S), lengths=published_lengths(),
                    prompts_per_step=32, n_samples=8, max_new_tokens=CAP, prompt_tokens=PROMPT,
                    update_s=PUBLISHED["update_s"], schedule="sync", partial_rollout=True, colocated=True, steps=4,
                    token_scale=64)
    return replace(base, **changes)


def split(gpus: int, engine_gpus: int, trainer_gpus: int, engine_size: int = GPUS) -> dict[str, Any]:
    """Scenario fields for ``engine_gpus`` of ``gpus`` serving (engines of ``engine_size`` GPUs, or one smaller
    engine) and ``trainer_gpus`` training, the batch grown with the GPUs (32 prompts per eight)."""
    size = min(engine_size, engine_gpus)
    return {"engines": max(1, engine_gpus // size), "engine": qwen3_30b_engine(size),
            "trainer": Trainer(TRAIN_TOKENS_S * trainer_gpus / GPUS), "prompts_per_step": 32 * gpus // GPUS,
            "colocated": False}


def within(measured: float, published: float) -> float:
    return measured / published - 1 if published else math.nan
