"""The learner: what happens to a batch of groups once they are generated, in every schedule and in replay.

:meth:`Learner.learn` takes the step's kept groups and trains one step on them: the rows (the parts of split
trajectories included), off-policy masking, the saved rollouts, the forward passes before the update (the
reference model's for a KL penalty in the reward, the value model's, the teacher's), the advantages and one
train step of the backend; it returns the training side of the step's metrics. Pushing the new weights is the
schedule's (:mod:`miles.loop.schedules`), which composes collect -> learn -> push.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from miles.errors import RunError
from miles.hookspecs import NeedsValues
from miles.loop.distill import Teacher, distill_advantages
from miles.loop.trajectories import TrajectoryWriter
from miles.train.losses import NonFiniteLoss
from miles.train.regularizers import kl_estimate, regularized
from miles.types import Group, Sample, TrainBatch

__all__ = ["Learner", "segment_advantages"]


@dataclass
class Learner:
    backend: Any  # a miles.hookspecs backend; None with run.rollout_only (nothing trains)
    advantage_fn: Callable[[TrainBatch], torch.Tensor]
    loss_fn: Callable[..., Any]
    pad_token_id: int
    mask_off_policy: bool = False  # zero the loss mask of tokens an older policy sampled
    kl_reward_coef: float = 0.0  # KL to the reference policy as a per-sequence reward penalty
    kl_estimator: str = "k3"
    teacher: Teacher | None = None  # on-policy distillation's per-token advantages
    # run.save_rollouts: called with each step's training samples before they train (miles.loop.saved_rollouts)
    save_rollouts: Callable[[int, list[Sample]], None] | None = None
    trajectories: TrajectoryWriter | None = None  # run.trajectories: a few groups of each step, for people to read
    # rollout.logprobs_of: the distribution log-probs are taken under, at each sample's recorded sampling parameters
    # (rollout.sampling for a sample that recorded none)
    logprobs_of: str = "model"
    sampling: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, p: Any, backend: Any, pad_token_id: int, **parts: Any) -> Learner:
        """The configured advantage, loss (with its regularizers) and KL penalty, on ``backend``."""
        config, reg = p.config, p.config.regularization
        loss = regularized(p.build("loss", "loss"), kl_coef=reg.kl_coef if reg.kl_in == "loss" else 0.0,
                           kl_estimator=reg.kl_estimator, entropy_coef=reg.entropy_coef)
        return cls(backend, p.build("advantage", "advantage"), loss, pad_token_id,
                   mask_off_policy=config.rollout.mask_off_policy, logprobs_of=str(config.rollout.logprobs_of),
                   sampling=OmegaConf.to_container(config.rollout.sampling),
                   kl_reward_coef=reg.kl_coef if reg.kl_in == "reward" else 0.0, kl_estimator=reg.kl_estimator,
                   **parts)

    def learn(self, step: int, groups: list[Group], metrics: dict[str, float]) -> bool:
        """Train one step on ``groups``, adding the training side of the step's metrics to ``metrics``; returns
        whether it trained (nothing to train on, or no backend: it did not, and nothing is to be pushed)."""
        train_samples = [s for g in groups for s in g.trainable_samples]
        # rollout.tito.on_mismatch=split: a trajectory's earlier parts train as rows of their own, after its rows
        owners = [(i, seg) for i, s in enumerate(train_samples) for seg in s.segments]
        for i, segment in owners:
            segment.reward = train_samples[i].reward
        rows = train_samples + [seg for _, seg in owners]
        if self.mask_off_policy:
            for sample in rows:
                sample.mask_off_policy()
        if self.save_rollouts is not None:  # before training: a step that fails to train is kept to replay
            self.save_rollouts(step, train_samples)
        trains = bool(train_samples) and self.backend is not None
        train_s = logprob_s = advantage_s = 0.0
        if trains:
            logprob_start = time.perf_counter()  # the forward passes before the update: reference, values, teacher
            batch = TrainBatch.from_samples(rows, self.pad_token_id, self.logprobs_of, self.sampling)
            if self.kl_reward_coef:
                kl = kl_estimate(batch.rollout_logprobs, self.backend.ref_logprobs(batch), self.kl_estimator) \
                    * batch.loss_mask
                batch.kl_penalty = self.kl_reward_coef * kl
                metrics["rollout/kl_penalty_mean"] = float(batch.kl_penalty.sum(dim=1).mean())
            if isinstance(self.advantage_fn, NeedsValues) and self.advantage_fn.needs_values:
                batch.values = self.backend.compute_values(batch)
            teacher_logprobs = self.teacher.logprobs(batch) if self.teacher is not None else None
            advantage_start = time.perf_counter()
            logprob_s = advantage_start - logprob_start
            batch.advantages = (segment_advantages(batch, self.advantage_fn, [i for i, _ in owners]) if owners
                                else self.advantage_fn(batch))
            if teacher_logprobs is not None:  # on-policy distillation: the teacher's per-token reverse KL
                batch.advantages, distilled = distill_advantages(batch, teacher_logprobs, self.teacher.kl_coef,
                                                                 self.teacher.reward_coef)
                metrics.update(distilled)
            self._check_advantages(step, batch, rows)
            metrics["train/nonzero_adv_frac"] = float((batch.advantages.abs().sum(dim=1) > 0).float().mean())
            if self.trajectories is not None:
                self._show(step, groups, train_samples, batch)
            train_start = time.perf_counter()
            advantage_s = train_start - advantage_start
            try:
                metrics.update(self.backend.train_step(batch, self.loss_fn))
            except NonFiniteLoss as exc:
                raise RunError(f"step {step}: {exc}") from None
            train_s = time.perf_counter() - train_start
            metrics["train/tokens_per_s"] = int(batch.attention_mask.sum()) / train_s
        else:
            metrics["train/tokens_per_s"] = 0.0
            if self.trajectories is not None:
                self._show(step, groups, train_samples, None)
        metrics["train/samples"] = len(rows)
        metrics["time/train_s"] = train_s
        metrics["time/logprob_s"] = logprob_s
        metrics["time/advantage_s"] = advantage_s
        return trains

    def _check_advantages(self, step: int, batch: TrainBatch, rows: list[Sample]) -> None:
        """Stop the run (RunError) before anything trains when an advantage is NaN or infinite: the loss, the
        gradients and then every weight would be NaN, and the run would stop only at the weight push, naming the
        weights. The error names the estimator and the rewards of the rows concerned."""
        bad = (~torch.isfinite(batch.advantages)).any(dim=1).nonzero().flatten().tolist()
        if not bad:
            return
        fn = self.advantage_fn.func if isinstance(self.advantage_fn, functools.partial) else self.advantage_fn
        name = getattr(fn, "__name__", type(fn).__name__)
        rewards = sorted({rows[i].scalar_reward for i in bad}, key=abs, reverse=True)
        shown = ", ".join(f"{r:g}" for r in rewards[:5]) + (f" and {len(rewards) - 5} more" if len(rewards) > 5
                                                             else "")
        raise RunError(f"step {step}: advantage {name!r} gave NaN or infinite advantages for {len(bad)} of "
                       f"{len(rows)} samples, whose rewards are {shown}; nothing was trained")

    def _show(self, step: int, groups: list[Group], train_samples: list[Sample], batch: TrainBatch | None) -> None:
        """Write the step's first groups for people to read, with the trainer's log-probs of the weights that are
        about to train (one more forward pass over those samples) and each token's advantage."""
        writer = self.trajectories
        shown = writer.shown(groups)
        if not shown:
            return
        row_of = {id(s): i for i, s in enumerate(train_samples)}
        rows = [row_of[id(s)] for s in shown if id(s) in row_of] if batch is not None else []
        logprobs = self.backend.compute_logprobs(batch.select(rows)) if rows else None
        position = {row: k for k, row in enumerate(rows)}  # a batch row's place among the forward pass's rows
        records = []
        for sample in shown:
            row = row_of.get(id(sample)) if rows else None
            if row is None:
                records.append(writer.record(step, sample, None, None))
                continue
            start = len(sample.prompt_ids) - 1  # response token i is predicted at column start + i
            end = start + len(sample.response_ids)
            records.append(writer.record(step, sample, batch.advantages[row, start:end].tolist(),
                                         logprobs[position[row], start:end].tolist()))
        writer.write(step, records)


def segment_advantages(batch: TrainBatch, advantage_fn: Callable, owners: list[int]) -> torch.Tensor:
    """Advantages when trajectories were split (``rollout.tito.on_mismatch=split``): the estimator sees one row
    per trajectory (its last part, the first rows of ``batch``), so groups count each trajectory once; the
    rows of earlier parts (after those, ``owners[j]``: the trajectory of part ``j``) take their trajectory's
    mean advantage over its loss tokens on every loss token of their own."""
    n = len(batch) - len(owners)
    trajectories = batch.select(list(range(n)))
    advantages = torch.zeros_like(batch.loss_mask)
    own = advantage_fn(trajectories)
    advantages[:n, : own.shape[1]] = own
    mask = trajectories.loss_mask
    means = (own * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    for j, owner in enumerate(owners):
        advantages[n + j] = means[owner] * batch.loss_mask[n + j]
    return advantages
