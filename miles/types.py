"""The data that flows between the stages of the loop.

A :class:`Sample` is one trajectory, token-exact: nothing downstream of the rollout engine ever
detokenizes and retokenizes what the policy produced. A :class:`Group` holds the samples of one
prompt. A :class:`TrainBatch` is the padded tensor form the training backend consumes.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # torch, NumPy and the MoE helpers are imported where used: `import miles` stays light
    import torch

    from miles.models.vision import ProcessedImage

__all__ = ["SampleStatus", "SampledWith", "Sample", "Group", "TrainBatch", "TokenSampling", "LossInputs", "Reward"]

Reward = float | dict[str, float]


class SampleStatus(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"  # hit max_new_tokens or the context length
    ABORTED = "aborted"  # stopped by the system (e.g. a weight update); may be continued
    FAILED = "failed"  # rollout, environment or reward error; never trained on


class SampledWith(NamedTuple):
    """The response tokens from ``start`` on (to the next record) were sampled with these parameters: the
    distribution their log-probs are taken under (``rollout.logprobs_of``, :mod:`miles.models.sampling`)."""

    start: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    @classmethod
    def of(cls, start: int, params: Mapping[str, Any]) -> "SampledWith":
        """From SGLang ``sampling_params`` (a missing one at SGLang's default)."""
        return cls(start, float(params.get("temperature", 1.0)), float(params.get("top_p", 1.0)),
                   int(params.get("top_k", -1)))

    @classmethod
    def add(cls, records: list["SampledWith"], start: int, params: Mapping[str, Any]) -> None:
        """Record in ``records`` that the response's tokens from ``start`` on were sampled with ``params``
        (a record only where the parameters change)."""
        entry = cls.of(start, params)
        if not records or tuple(records[-1])[1:] != tuple(entry)[1:]:
            records.append(entry)

    def neutral(self, truncated: bool) -> bool:
        """Whether these tokens' distribution is the model's own (temperature 1 or greedy, and, where the
        truncated distribution is asked for, no top-p or top-k)."""
        return self.temperature in (0.0, 1.0) and (not truncated or self.temperature == 0.0
                                                     or (self.top_p >= 1.0 and self.top_k <= 0))


@dataclass
class Sample:
    """One trajectory.

    ``response_ids`` holds every token after the prompt, tool observations included;
    ``loss_mask[i]`` is 1 where the policy produced ``response_ids[i]`` and 0 for observations;
    ``rollout_logprobs[i]`` is the engine's log-prob of ``response_ids[i]`` (0.0 where masked);
    ``sampled_with`` the sampling parameters of the response's tokens, from the first it holds on (none recorded:
    the run's ``rollout.sampling``).
    """

    prompt_ids: list[int]
    group_index: int = 0
    index: int = 0  # position inside its group
    prompt: Any = None  # the prompt as it came from the data (text or messages)
    label: Any = None
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    response_text: str = ""
    reward: Reward | None = None
    status: SampleStatus = SampleStatus.PENDING
    reason: str = ""  # why it is truncated, aborted or failed
    weight_versions: list[int] = field(default_factory=list)  # the policy versions that sampled it, in order
    off_policy_tokens: int = 0  # leading response tokens sampled by an older policy than the newest that sampled it
    turns: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    # MoE models with rollout.return_routed_experts: the engine's expert ids for each input position of
    # prompt_ids + response_ids ([positions, num_layers * top_k], miles.models.moe.compact form); observation tokens
    # have none (routed by the trainer as usual). None when not recorded.
    routed_experts: Any = field(default=None, repr=False)
    # rollout.tito.on_mismatch=split: the earlier parts of this trajectory, each a sample of its own (prompt, tokens,
    # mask, log-probs) that trains with this trajectory's reward and advantage; this sample is the last part
    segments: list["Sample"] = field(default_factory=list, repr=False)
    # vision-language models: the images whose tokens prompt_ids + response_ids hold (each a span of
    # <|image_pad|> tokens), in order, as the image processor made them (miles.models.vision)
    images: list[ProcessedImage] = field(default_factory=list, repr=False)
    sampled_with: list[SampledWith] = field(default_factory=list)

    @property
    def trainable(self) -> bool:
        return self.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)

    @property
    def scalar_reward(self) -> float:
        """The reward as one number: a dict reward contributes its ``"score"`` entry."""
        if self.reward is None:
            raise ValueError(f"sample {self.group_index}/{self.index} has no reward yet")
        if isinstance(self.reward, dict):
            return float(self.reward["score"])
        return float(self.reward)

    def mask_off_policy(self) -> None:
        """Leave the tokens an older policy sampled (before a partial rollout was continued) out of the loss."""
        self.loss_mask[: self.off_policy_tokens] = [0] * min(self.off_policy_tokens, len(self.loss_mask))

    @property
    def start_version(self) -> int | None:
        """The oldest policy version that sampled any of its tokens (None before the first generation)."""
        return min(self.weight_versions) if self.weight_versions else None

    def record_versions(self, start: int, meta: dict[str, Any]) -> None:
        """Record the versions that sampled ``response_ids[start:]``, from an engine answer's ``meta_info``:
        ``output_token_weight_versions`` (one per token, where a weight update landed mid-request) or else
        ``weight_version``. When a newer version starts, every earlier token becomes off-policy."""
        count = len(self.response_ids) - start
        versions = meta.get("output_token_weight_versions") or [int(meta["weight_version"])] * max(1, count)
        for offset, version in enumerate(int(v) for v in versions):
            if self.weight_versions and version > max(self.weight_versions):
                self.off_policy_tokens = start + offset
            if not self.weight_versions or offset == 0 or version != self.weight_versions[-1]:
                self.weight_versions.append(version)

    def record_sampling(self, start: int, params: Mapping[str, Any]) -> None:
        """Record that ``response_ids[start:]`` were sampled with ``params`` (SGLang ``sampling_params``)."""
        SampledWith.add(self.sampled_with, start, params)

    def record_routing(self, meta: dict[str, Any], input_len: int) -> None:
        """Keep the expert ids of an engine answer (``meta_info["routed_experts"]``, SGLang's form) for the
        positions this sample has none for yet. The answer fed ``input_len`` tokens (the request's prompt: this
        sample's tokens before the answer's outputs were appended) and all its outputs but the last. Positions
        recorded by an earlier answer keep their ids (their log-probs were computed with them); observation
        tokens get none."""
        data = meta.get("routed_experts")
        if data is None:
            return
        import numpy as np

        from miles.models.moe import NO_EXPERT, compact, decode_routed_experts, expand

        fed = input_len + max(int(meta.get("completion_tokens", 0)), 1) - 1
        new = decode_routed_experts(data, fed)
        old = None if self.routed_experts is None else expand(self.routed_experts)
        if old is not None and old.shape[1] != new.shape[1]:
            raise ValueError(f"routed_experts: {new.shape[1]} expert ids per token after {old.shape[1]} in the same "
                             f"sample (answers from different models)")
        start = 0 if old is None else old.shape[0]
        merged = new.copy() if old is None else np.concatenate([old, new[start:]])
        observation = [len(self.prompt_ids) + i for i, m in enumerate(self.loss_mask) if not m]
        observation = [p for p in observation if start <= p < len(merged)]
        merged[observation] = NO_EXPERT
        self.routed_experts = compact(merged)

    def split(self, prompt_ids: list[int], reason: str, images: Sequence[ProcessedImage] = ()) -> None:
        """End the trajectory's current part as a segment and go on from ``prompt_ids`` (the history as the
        template renders it now, holding ``images``) with an empty response."""
        segment = Sample(prompt_ids=self.prompt_ids, group_index=self.group_index, index=self.index, prompt=self.prompt,
                         label=self.label, response_ids=self.response_ids, loss_mask=self.loss_mask,
                         rollout_logprobs=self.rollout_logprobs, status=SampleStatus.COMPLETED, reason=reason,
                         weight_versions=list(self.weight_versions), off_policy_tokens=self.off_policy_tokens,
                         turns=self.turns, routed_experts=self.routed_experts, images=self.images,
                         sampled_with=self.sampled_with)
        self.segments.append(segment)
        self.prompt_ids, self.response_ids, self.loss_mask, self.rollout_logprobs = list(prompt_ids), [], [], []
        self.images, self.sampled_with = list(images), []
        self.off_policy_tokens, self.routed_experts = 0, None

    def truncate_response(self, length: int) -> None:
        """Keep the first ``length`` response tokens (with their mask, log-probs and routing)."""
        del self.response_ids[length:], self.loss_mask[length:], self.rollout_logprobs[length:]
        self.off_policy_tokens = min(self.off_policy_tokens, length)
        self.sampled_with = [entry for entry in self.sampled_with if entry.start < length] or self.sampled_with[:1]
        if self.routed_experts is not None:
            from miles.models.moe import compact, expand

            self.routed_experts = compact(expand(self.routed_experts)[: len(self.prompt_ids) + length])

    def fail(self, reason: str) -> None:
        self.status = SampleStatus.FAILED
        self.reason = reason

    def append(self, token_ids: list[int], logprobs: list[float] | None, *, from_policy: bool) -> None:
        """Append tokens to the response, keeping mask and log-probs aligned."""
        self.response_ids.extend(token_ids)
        self.loss_mask.extend([int(from_policy)] * len(token_ids))
        if logprobs is None:
            logprobs = [0.0] * len(token_ids)
        if len(logprobs) != len(token_ids):
            raise ValueError(f"{len(logprobs)} log-probs for {len(token_ids)} tokens")
        self.rollout_logprobs.extend(logprobs)


@dataclass
class Group:
    """The ``n`` samples drawn for one prompt."""

    index: int
    samples: list[Sample]

    @property
    def rewards(self) -> list[float]:
        return [s.scalar_reward for s in self.samples if s.trainable]

    @property
    def trainable_samples(self) -> list[Sample]:
        return [s for s in self.samples if s.trainable]


@dataclass
class TrainBatch:
    """Padded tensors for ``B`` sequences of at most ``L`` tokens (prompt + response).

    Per-token tensors are *target-aligned* (``L - 1`` wide): column ``t`` describes token ``t + 1``
    of ``input_ids``, which the model predicts from the logits at position ``t``.
    """

    input_ids: torch.Tensor  # [B, L] long, right-padded
    attention_mask: torch.Tensor  # [B, L] long
    loss_mask: torch.Tensor  # [B, L-1] float, 1 where the policy produced the target token
    rollout_logprobs: torch.Tensor  # [B, L-1] float, engine log-probs of target tokens
    rewards: torch.Tensor  # [B] float
    group_index: torch.Tensor  # [B] long
    advantages: torch.Tensor | None = None  # [B, L-1] float, filled by the advantage estimator
    samples: list[Sample] = field(default_factory=list, repr=False)
    kl_penalty: torch.Tensor | None = None  # [B, L-1] KL-to-reference penalty per token (kl_in: reward)
    values: torch.Tensor | None = None  # [B, L-1] the value model's estimates before the update (PPO)
    returns: torch.Tensor | None = None  # [B, L-1] the value targets, set by estimators that train a critic
    # [B, L, num_layers * top_k] int16: the engine's expert ids of each input token (-1: none), from the samples'
    # routed_experts (MoE models with rollout.return_routed_experts); position-aligned like input_ids
    routed_experts: torch.Tensor | None = None
    # vision-language models: each row's images, in the order of its image spans (None: no row has any)
    images: list[list[ProcessedImage]] | None = None
    # the distribution each target token's log-prob is taken under (rollout.logprobs_of); None: the model's own
    sampling: TokenSampling | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def sequence_rewards(self) -> torch.Tensor:
        """``[B]`` rewards less each sequence's summed KL penalty (when KL is a reward penalty)."""
        if self.kl_penalty is None:
            return self.rewards
        return self.rewards - (self.kl_penalty * self.loss_mask).sum(dim=1)

    @property
    def num_sequences(self) -> int:
        """Sequences with at least one loss token."""
        return int((self.loss_mask.sum(dim=1) > 0).sum().item())

    @property
    def num_tokens(self) -> int:
        """Tokens that count in the loss."""
        return int(self.loss_mask.sum().item())

    def select(self, rows: slice | torch.Tensor | list[int]) -> "TrainBatch":
        """A view of some rows (for micro-batches); trailing all-padding columns are trimmed."""
        if isinstance(rows, slice) or not self.samples:  # a batch sent to another process has no samples
            samples = self.samples[rows] if isinstance(rows, slice) else []
        else:
            samples = [self.samples[i] for i in (rows.tolist() if hasattr(rows, "tolist") else rows)]
        attention_mask = self.attention_mask[rows]
        width = int(attention_mask.sum(dim=1).max().item()) if len(attention_mask) else 0
        width = max(width, 2)
        return TrainBatch(
            input_ids=self.input_ids[rows, :width],
            attention_mask=attention_mask[:, :width],
            loss_mask=self.loss_mask[rows, : width - 1],
            rollout_logprobs=self.rollout_logprobs[rows, : width - 1],
            rewards=self.rewards[rows],
            group_index=self.group_index[rows],
            advantages=None if self.advantages is None else self.advantages[rows, : width - 1],
            samples=samples,
            kl_penalty=None if self.kl_penalty is None else self.kl_penalty[rows, : width - 1],
            values=None if self.values is None else self.values[rows, : width - 1],
            returns=None if self.returns is None else self.returns[rows, : width - 1],
            routed_experts=None if self.routed_experts is None else self.routed_experts[rows, :width],
            images=None if self.images is None else (
                self.images[rows] if isinstance(rows, slice) else
                [self.images[i] for i in (rows.tolist() if hasattr(rows, "tolist") else rows)]),
            sampling=None if self.sampling is None else self.sampling.select(rows, width - 1),
        )

    @classmethod
    def from_samples(cls, samples: list[Sample], pad_token_id: int, logprobs_of: str = "model",
                     sampling: Mapping[str, Any] | None = None) -> "TrainBatch":
        """The padded batch of ``samples``. ``logprobs_of`` (``rollout.logprobs_of``): the distribution their
        log-probs are taken under, from each sample's ``sampled_with`` (``sampling``, the run's
        ``rollout.sampling``, for a sample that recorded none); ``model``: the model's own."""
        if not samples:
            raise ValueError("cannot build a TrainBatch from no samples")
        import torch
        width = max(2, max(len(s.prompt_ids) + len(s.response_ids) for s in samples))
        input_ids, attention_mask, loss_mask, logprobs = [], [], [], []
        for s in samples:
            length = len(s.prompt_ids) + len(s.response_ids)
            pad = width - length
            input_ids.append(s.prompt_ids + s.response_ids + [pad_token_id] * pad)
            attention_mask.append([1] * length + [0] * pad)
            # Response token i sits at position len(prompt) + i and is predicted at column len(prompt) + i - 1.
            lead = [0] * (len(s.prompt_ids) - 1)
            loss_mask.append(lead + s.loss_mask + [0] * pad)
            logprobs.append(lead + s.rollout_logprobs + [0.0] * pad)
        rewards = [s.scalar_reward if s.reward is not None else math.nan for s in samples]
        return cls(
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            attention_mask=torch.tensor(attention_mask, dtype=torch.long),
            loss_mask=torch.tensor(loss_mask, dtype=torch.float),
            rollout_logprobs=torch.tensor(logprobs, dtype=torch.float),
            rewards=torch.tensor(rewards, dtype=torch.float),
            group_index=torch.tensor([s.group_index for s in samples], dtype=torch.long),
            samples=samples,
            routed_experts=_routed_experts(samples, width),
            images=[list(s.images) for s in samples] if any(s.images for s in samples) else None,
            sampling=TokenSampling.of(samples, width - 1, logprobs_of, sampling),
        )


@dataclass
class TokenSampling:
    """Per target token (``[B, L-1]``, aligned like the loss mask): the distribution its log-prob is taken under
    (:func:`miles.models.sampling.distribution_logits`). ``top_p`` and ``top_k`` only for ``rollout.logprobs_of:
    truncated``."""

    temperature: torch.Tensor  # [B, L-1] float; 1 where nothing was sampled (the prompt, padding), 0: greedy
    top_p: torch.Tensor | None = None  # [B, L-1] float, 1.0: off
    top_k: torch.Tensor | None = None  # [B, L-1] long, -1: off

    def select(self, rows: slice | torch.Tensor | list[int], width: int) -> "TokenSampling":
        return TokenSampling(*(None if t is None else t[rows, :width] for t in (self.temperature, self.top_p,
                                                                                 self.top_k)))

    def on(self, device: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(temperature, top_p, top_k)`` on ``device``, as :func:`miles.models.sampling.distribution_logits`
        takes them."""
        return tuple(None if t is None else t.to(device) for t in (self.temperature, self.top_p, self.top_k))

    def row(self, row: int, length: int, device: Any) -> dict[str, torch.Tensor]:
        """One row's first ``length`` columns, as :func:`miles.models.hf.exact_logprobs` takes them."""
        return {name: t[row, :length].to(device) for name, t in (("temperature", self.temperature),
                                                                  ("top_p", self.top_p), ("top_k", self.top_k))
                if t is not None}

    @classmethod
    def of(cls, samples: list[Sample], width: int, logprobs_of: str,
           default: Mapping[str, Any] | None) -> TokenSampling | None:
        """The samples' distributions ``[B, width]``; None when every token's is the model's own."""
        if logprobs_of == "model":
            return None
        truncated = logprobs_of == "truncated"
        fallback = [SampledWith.of(0, default or {})]
        runs = [s.sampled_with or fallback for s in samples]
        if all(entry.neutral(truncated) for entries in runs for entry in entries):
            return None
        import torch

        temperature = torch.ones((len(samples), width))
        top_p = torch.ones((len(samples), width)) if truncated else None
        top_k = torch.full((len(samples), width), -1, dtype=torch.long) if truncated else None
        for row, (sample, entries) in enumerate(zip(samples, runs)):
            lead = len(sample.prompt_ids) - 1  # response token i is predicted at column lead + i
            for i, entry in enumerate(entries):
                end = entries[i + 1].start if i + 1 < len(entries) else len(sample.response_ids)
                columns = slice(lead + entry.start, lead + end)
                temperature[row, columns] = entry.temperature
                if truncated:
                    top_p[row, columns] = entry.top_p
                    top_k[row, columns] = entry.top_k
        return cls(temperature, top_p, top_k)


def _routed_experts(samples: list[Sample], width: int) -> torch.Tensor | None:
    """``[B, width, ids per token]`` int16 from the samples' routed_experts (-1 where a sample has none)."""
    recorded = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not recorded:
        return None
    import torch

    from miles.models.moe import expand

    out = torch.full((len(samples), width, recorded[0].shape[1]), -1, dtype=torch.int16)
    for row, s in enumerate(samples):
        if s.routed_experts is not None:
            ids = torch.from_numpy(expand(s.routed_experts)[:width])
            out[row, : ids.shape[0]] = ids.to(torch.int16)
    return out


@dataclass
class LossInputs:
    """What a loss function receives for one micro-batch (all per-token tensors ``[b, L-1]``)."""

    logprobs: torch.Tensor  # current policy, with grad
    old_logprobs: torch.Tensor  # the policy that sampled the tokens
    advantages: torch.Tensor | None  # None where no estimator ran (SFT)
    loss_mask: torch.Tensor
    token_normalizer: float  # loss-mask tokens in the whole batch: divide sums by it
    batch: TrainBatch
    ref_logprobs: torch.Tensor | None = None  # the frozen reference policy, when one is configured
    entropy: torch.Tensor | None = None  # of the policy at each position; with grad if the loss sets needs_entropy_grad
    sequence_normalizer: float = 1.0  # sequences with loss tokens in the whole batch (sequence-level aggregations)
