"""A speculative draft that keeps up with the policy (``rollout.engine.speculative.train: true``).

The policy moves every step, and a fixed draft's proposals are kept less and less often. Each step, the draft
learns the step's rollouts: the cross-entropy of the tokens the policy sampled, a Monte-Carlo estimate of the
forward KL from the policy's distribution to the draft's (up to the policy's entropy, which the draft cannot
change). Its weights go to the engines with the policy's, as ``draft.*`` tensors (the engines' version stays the
policy's).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from miles.engine.speculative import DRAFT_PREFIX, SpeculativeConfig, draft_config
from miles.models import hf
from miles.types import Group

__all__ = ["DraftLearner"]

_log = logging.getLogger(__name__)


class DraftLearner:
    def __init__(self, spec: SpeculativeConfig, model_path: str, seed: int, *, lr: float = 1e-3,
                 batch_size: int = 32) -> None:
        if "path" in spec.draft:
            self.model = hf.load_model(spec.draft["path"])
        else:
            config = draft_config(hf.load_model_config(model_path), spec.draft["build"])
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                self.model = hf.causal_lm_from_config(config)
        self.model.train()
        self.pad = int(self.model.config.get_text_config().pad_token_id or 0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.batch_size = batch_size

    def learn(self, groups: list[Group]) -> dict[str, float]:
        """One pass over the trainable samples of ``groups`` (``batch_size`` sequences an optimizer step); the mean
        loss of the tokens the policy sampled."""
        sequences = [(s.prompt_ids, s.response_ids, s.loss_mask) for g in groups for s in g.trainable_samples
                     if any(s.loss_mask)]
        if not sequences:
            return {}
        total, tokens = 0.0, 0
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start:start + self.batch_size]
            width = max(len(p) + len(r) for p, r, _ in chunk)
            ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
            labels = torch.full((len(chunk), width), -100, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, (prompt, response, policy) in enumerate(chunk):
                seq = list(prompt) + list(response)
                ids[i, : len(seq)] = torch.tensor(seq)
                mask[i, : len(seq)] = 1
                # the tokens the policy sampled (a tool's or an environment's output is not the policy's)
                labels[i, len(prompt): len(seq)] = torch.tensor([t if m else -100 for t, m in zip(response, policy)])
            logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            targets = labels[:, 1:]
            loss_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                         ignore_index=-100, reduction="sum")
            n = int((targets != -100).sum())
            self.optimizer.zero_grad(set_to_none=True)
            (loss_sum / n).backward()
            self.optimizer.step()
            total, tokens = total + float(loss_sum.detach()), tokens + n
        return {"rollout/spec_draft_loss": total / tokens}

    def weights(self) -> dict[str, torch.Tensor]:
        """The draft's weights as a push carries them."""
        return {DRAFT_PREFIX + name: t.detach().clone() for name, t in self.model.state_dict().items()}

    def push(self, plane: Any) -> None:
        """Send the draft's weights to every engine (in-process engines directly, servers as safetensors bytes
        to ``/update_weights_from_tensor``)."""
        weights = self.weights()
        if plane.router is None:
            for engine in plane.local_engines:
                engine.update_weights(weights)
            return
        from miles.weights.wire import tensor_bytes

        plane.post_all("/update_weights_from_tensor", tensor_bytes(weights),
                       params={"weight_version": str(plane.weight_version)})
