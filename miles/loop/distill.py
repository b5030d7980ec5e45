"""On-policy distillation: the student samples, a teacher scores the sampled tokens, and each token's
advantage is the negative per-token reverse KL ``log p_teacher(t) - log p_student(t)``, optionally mixed with
the RL advantages (``distill.reward_coef``).

The teacher is a second model served by an engine of its own: in process from an HF directory
(``distill.teacher``) or any SGLang-compatible server (``distill.teacher_url``: SGLang, ``miles engine serve``).
It scores a trajectory with one ``/generate`` request over the prompt and the response with
``return_logprob`` and ``logprob_start_len`` at the response (SGLang's ``input_token_logprobs``), so the
teacher's log-probs are of the exact tokens the student sampled, observations of multi-turn rollouts
included (they are out of the loss mask).

Minimising the reverse KL ``E_student[log p_student - log p_teacher]`` by the policy gradient with this
per-token advantage (no discounting across tokens) is the on-policy distillation of Agarwal et al. (GKD) and
of Thinking Machines' write-up; with ``reward_coef > 0`` the reward's advantages are added.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Callable

import torch

from miles.errors import ConfigError
from miles.types import Sample, TrainBatch

__all__ = ["Teacher", "make_teacher", "start_teacher", "check_teacher", "distill_advantages"]


class Teacher:
    """Scores samples with a teacher engine (anything with SGLang's ``generate``)."""

    def __init__(self, client: Any, run: Callable, kl_coef: float, reward_coef: float) -> None:
        self.client, self.run, self.kl_coef, self.reward_coef = client, run, kl_coef, reward_coef

    async def _score(self, sample: Sample) -> list[float]:
        out = await self.client.generate(sample.prompt_ids + sample.response_ids,
                                         {"max_new_tokens": 0, "temperature": 0.0}, True,
                                         logprob_start_len=len(sample.prompt_ids))
        logprobs = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
        if len(logprobs) != len(sample.response_ids) or any(lp is None for lp in logprobs):
            raise RuntimeError(f"distill: the teacher returned {len(logprobs)} log-probs for a response of "
                               f"{len(sample.response_ids)} tokens")
        return logprobs

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, L-1]`` the teacher's log-probs of the batch's response tokens, target-aligned like
        ``batch.rollout_logprobs`` (0 elsewhere)."""
        async def all_samples() -> list[list[float]]:
            return await asyncio.gather(*(self._score(s) for s in batch.samples))

        out = torch.zeros_like(batch.rollout_logprobs)
        for row, (sample, logprobs) in enumerate(zip(batch.samples, self.run(all_samples()))):
            start = len(sample.prompt_ids) - 1
            out[row, start:start + len(logprobs)] = torch.tensor(logprobs, dtype=out.dtype)
        return out


def distill_advantages(batch: TrainBatch, teacher_logprobs: torch.Tensor, kl_coef: float,
                       reward_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    """``reward_coef * advantages - kl_coef * (log p_student - log p_teacher)`` on the loss tokens, and the
    step's ``distill/*`` metrics (per loss token)."""
    mask = batch.loss_mask
    reverse_kl = (batch.rollout_logprobs - teacher_logprobs) * mask
    tokens = mask.sum().clamp(min=1)
    advantages = -kl_coef * reverse_kl
    if reward_coef:
        advantages = advantages + reward_coef * batch.advantages
    return advantages * mask, {
        "distill/reverse_kl": float(reverse_kl.sum() / tokens),
        "distill/teacher_logprob_mean": float((teacher_logprobs * mask).sum() / tokens),
        "distill/student_logprob_mean": float((batch.rollout_logprobs * mask).sum() / tokens),
    }


def _vocab_size(model_dir: str) -> int | None:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("vocab_size")


def make_teacher(distill: Any, p: Any, student_dir: str, closing: Any) -> Teacher | None:
    """The run's teacher (None without ``distill.teacher`` or ``distill.teacher_url``); ``closing`` (an
    ExitStack) stops its engine or client."""
    if not (distill.teacher or distill.teacher_url):
        return None
    return Teacher(*start_teacher(distill, p, student_dir, closing), distill.kl_coef, distill.reward_coef)


def start_teacher(distill: Any, p: Any, student_dir: str, closing: Any) -> tuple[Any, Callable]:
    """The teacher's engine client and how to run coroutines on it: an in-process engine loading
    ``distill.teacher``, or a router in front of ``distill.teacher_url``."""
    from miles import interrupts
    from miles.config.validate import split_node
    from miles.rollout.plane import EventLoopThread
    from miles.engine.router import Router

    if distill.teacher_url:
        loop = EventLoopThread()
        closing.callback(loop.close)
        router = Router([distill.teacher_url])
        loop.run(router.start())
        closing.callback(lambda: loop.run(router.close()))
        return router, loop.run
    check_teacher(distill, student_dir)
    engine_args, _ = split_node(p.config.rollout.engine, "rollout.engine")
    if engine_args["name"] != "local":  # the teacher runs in process: the embedded engine, default settings
        engine_args = {"name": "local"}
    engine = p.registry.build("rollout_engine", engine_args, "rollout.engine")
    engine.load_model(str(distill.teacher))
    closing.callback(engine.close)
    return engine, interrupts.run


def check_teacher(distill: Any, student_dir: str) -> None:
    """``distill.teacher`` is an HF directory whose vocabulary is the student's (a ConfigError otherwise)."""
    if not distill.teacher:
        return
    path = Path(distill.teacher)
    if not (path / "config.json").is_file():
        raise ConfigError(f"distill.teacher {str(path)!r} is not an HF model directory (no config.json there)")
    if _vocab_size(str(path)) != _vocab_size(student_dir):
        raise ConfigError(f"distill.teacher {str(path)!r} has a vocabulary of {_vocab_size(str(path))} tokens, the "
                          f"student {_vocab_size(student_dir)}: the teacher scores the student's token ids, so both "
                          f"need the same tokenizer")
