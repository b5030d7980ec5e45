"""A speculative draft that keeps up with the policy (``rollout.engine.speculative.train: true``).

The policy moves every step, and a fixed draft's proposals are kept less and less often. Each step, once the
policy has learnt, the draft learns the rollouts of the last ``window`` steps (this one's and those before it)
towards the policy's new distribution: at every token the policy sampled (not a tool's or an environment's), the KL
from the policy's distribution at the sample's temperature to the draft's, the policy's computed by a copy of it in
the driver that loads the trainer's exported weights (one forward without gradients). One step's rollouts teach the
policy's move on their prompts only; the next step's prompts are others, and the move the draft learnt on eight
steps' prompts holds better on them (over 200 quickstart steps, 8.6-10.2% below its start at the lowest, against
16% with one step's: docs/benchmarks.md). A backend that exports no whole weights (LoRA adapters) leaves the
cross-entropy of the sampled tokens, a noisier estimate of the same KL (up to the policy's entropy). Its weights go
to the engines with the policy's, as ``draft.*`` tensors (the engines' version stays the policy's).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from miles.engine.speculative import DRAFT_PREFIX, SpeculativeConfig, draft_config
from miles.models import hf
from miles.models.mtp import build_head, checkpoint_head
from miles.types import Group

__all__ = ["DraftLearner"]

_log = logging.getLogger(__name__)


class DraftLearner:
    def __init__(self, spec: SpeculativeConfig, model_path: str, seed: int, *, lr: float = 3e-4,
                 batch_size: int = 16, window: int = 8) -> None:
        self.mtp = "mtp" in spec.draft
        if self.mtp:
            config = hf.load_model_config(model_path)
            self.model = checkpoint_head(model_path, config) or build_head(config, seed)
        elif "path" in spec.draft:
            self.model = hf.load_model(spec.draft["path"])
        else:
            config = draft_config(hf.load_model_config(model_path), spec.draft["build"])
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                self.model = hf.causal_lm_from_config(config)
        self.model.train()
        config = hf.load_model_config(model_path) if self.mtp else self.model.config
        self.pad = int(config.get_text_config().pad_token_id or 0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.batch_size, self.window = batch_size, window
        self._recent: list[list[tuple[torch.Tensor, ...]]] = []  # each of the last steps' batches, the newest last
        self.model_path = model_path
        self.teacher: Any = None  # the policy, loaded from its exported weights each step
        self._learnt: dict[str, torch.Tensor] | None = None
        self._no_teacher = False
        self._base: Any = None  # an MTP head's hidden states without a teacher: the model at model_path

    def learn(self, groups: list[Group], policy: Any = None) -> dict[str, float]:
        """One pass over the trainable samples of ``groups`` and of the steps before it in the window
        (``batch_size`` sequences an optimizer step) towards ``policy``'s distribution (a backend whose
        ``export_weights()`` are the new policy's), or the sampled tokens without one; the mean loss of the tokens
        the policy sampled."""
        samples = [s for g in groups for s in g.trainable_samples if any(s.loss_mask)]
        if not samples:
            return {}
        teacher = self._teacher(policy)
        step = [_batch(samples[start:start + self.batch_size], self.pad)
                for start in range(0, len(samples), self.batch_size)]
        self._recent = [*self._recent, step][-self.window:]
        total, tokens = 0.0, 0
        for ids, mask, labels, temperature in (batch for recent in self._recent for batch in recent):
            logits, policy_logits = self._forward(ids, mask, teacher)
            targets, used = labels[:, 1:], labels[:, 1:] != -100
            n = int(used.sum())
            if policy_logits is not None:  # KL(policy || draft) at each sampled position, both at its temperature
                p = (policy_logits[used] / temperature[used].unsqueeze(-1)).log_softmax(-1)
                q = (logits[used] / temperature[used].unsqueeze(-1)).log_softmax(-1)
                loss_sum = (p.exp() * (p - q)).sum()
            else:
                loss_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                             targets.reshape(-1), ignore_index=-100, reduction="sum")
            self.optimizer.zero_grad(set_to_none=True)
            (loss_sum / n).backward()
            self.optimizer.step()
            total, tokens = total + float(loss_sum.detach()), tokens + n
        self._learnt = self.weights()  # what the next push sends (a streaming schedule pushes from a thread)
        return {"rollout/spec_draft_loss": total / tokens}

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, teacher: Any) -> tuple[torch.Tensor, Any]:
        """The draft's logits for each next token ``[B, T - 1, V]``, and the teacher's (None without one). An MTP
        head reads the policy's hidden states (the teacher's, else the model at model_path's) and shares its
        embedding and output layer, which it does not train."""
        if not self.mtp:
            logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            if teacher is None:
                return logits, None
            with torch.no_grad():
                return logits, teacher(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        source = teacher if teacher is not None else self._base_model()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            hidden = source.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
            embeds = source.get_input_embeddings()(ids)
        before = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)
        head = source.get_output_embeddings()
        logits = head(self.model(embeds, before, mask, positions)[:, :-1]).float()
        if teacher is None:
            return logits, None
        with torch.no_grad():
            return logits, head(hidden[:, :-1]).float()

    def _base_model(self) -> Any:
        if self._base is None:
            self._base = hf.load_model(self.model_path).eval()
            self._base.requires_grad_(False)
        return self._base

    def _teacher(self, policy: Any) -> Any:
        """The policy as a model in this process, with ``policy``'s exported weights (None without them)."""
        if policy is None or self._no_teacher:
            return None
        weights = policy.export_weights()
        if self.teacher is None:
            self.teacher = hf.load_model(self.model_path).eval()
            self.teacher.requires_grad_(False)
        try:
            self.teacher.load_state_dict(weights, strict=True)
        except (RuntimeError, KeyError) as exc:  # e.g. LoRA adapters only: the sampled tokens it is
            _log.warning("the speculative draft learns the sampled tokens: the policy's exported weights do not "
                         "load into a copy of it (%s)", str(exc).splitlines()[0])
            self._no_teacher, self.teacher = True, None
            return None
        return self.teacher

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the draft's weights, its optimizer's state and the window's rollouts."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "recent": self._recent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._recent = state.get("recent", [])
        self._learnt = None  # the next push sends the loaded weights

    def weights(self) -> dict[str, torch.Tensor]:
        """The draft's weights as a push carries them."""
        return {DRAFT_PREFIX + name: t.detach().clone() for name, t in self.model.state_dict().items()}

    def push(self, plane: Any) -> None:
        """Send the draft's weights to every engine (in-process engines directly, servers as safetensors bytes
        to ``/update_weights_from_tensor``)."""
        weights = self._learnt if self._learnt is not None else self.weights()
        if plane.router is None:
            for engine in plane.local_engines:
                engine.update_weights(weights)
            return
        from miles.weights.wire import tensor_bytes

        plane.post_all("/update_weights_from_tensor", tensor_bytes(weights),
                       params={"weight_version": str(plane.weight_version)})


def _batch(samples: list[Any], pad: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ids and mask, labels (-100 where not a policy token) and each position's temperature."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    temperature = torch.ones((len(samples), width))
    for i, s in enumerate(samples):
        seq, start = list(s.prompt_ids) + list(s.response_ids), len(s.prompt_ids)
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, start: len(seq)] = torch.tensor([t if m else -100 for t, m in zip(s.response_ids, s.loss_mask)])
        for record in s.sampled_with:  # the token at response position j was drawn at this temperature
            temperature[i, start + record.start - 1: len(seq) - 1] = record.temperature or 1.0
    return ids, mask, labels, temperature[:, :-1]
