"""Speculative sampling in the embedded engine: a small draft proposes ``k`` tokens, the target scores them in one
forward, and each proposal is kept with probability ``min(1, p/q)``; at the first one refused, the token is drawn
from ``max(0, p - q)`` renormalised, and when all ``k`` are kept, one more is drawn from the target's next
distribution. ``p`` and ``q`` are the distributions the engine draws from (temperature, top-k and top-p applied
to both, :mod:`miles.models.sampling`), so the tokens follow the target's distribution exactly; a greedy row keeps a
proposal only where it is the target's argmax, and so gives the very tokens plain decoding gives.

``rollout.engine.speculative`` (the ``local`` engine's argument)::

    speculative:
      draft: {path: /models/draft}       # or {build: {hidden_size: 64, num_layers: 1, ...}}: the target's
                                         # architecture, smaller, at random (train: true teaches it); or mtp:
                                         # a multi-token-prediction head on the target's hidden states, the
                                         # one its checkpoint ships (DeepSeek-V3, Qwen3-Next) or built at
                                         # random (miles.models.mtp, miles.engine.draft.MTPDraft)
      num_tokens: 4                      # k, the proposals per target forward
      when: tail                         # tail: only while at most tail_rows rows decode; always
      tail_rows: 16
      train: false                       # each step, the draft learns the policy's samples (miles.loop.draft)
      lr: 0.0003                         # its learning rate (AdamW, 16 sequences a step)
      force: false                       # speculate even where the estimate says it cannot pay (see pays)

The draft keeps its own K/V cache laid out column for column as the target's (one attention mask serves both); a
refused proposal's column stays in both caches, masked, until the batch is packed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.lazy import lazy_module
from miles.models.sampling import scaled_logits, truncated_logits

torch = lazy_module("torch")

__all__ = ["SpeculativeConfig", "accept", "check_draft", "draft_distribution", "pays", "DRAFT_PREFIX", "BUILD_FIELDS"]

DRAFT_PREFIX = "draft."  # a weight update's tensors for the draft (the rest are the target's)
WHEN = ("tail", "always")
# what a built draft may change of the target's architecture (the vocabulary stays: the same tokenizer)
BUILD_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
_CONFIG_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                 "num_kv_heads": "num_key_value_heads"}
# A forward's cost that does not grow with the model (launching its kernels, Python), in parameters' worth: what
# makes a draft of a tiny target cost as much as the target (benchmarks/speculative.py measures it on a CPU).
FORWARD_OVERHEAD_PARAMS = 4_000_000


@dataclass(frozen=True)
class SpeculativeConfig:
    draft: dict[str, Any] = field(default_factory=dict)
    num_tokens: int = 4
    when: str = "tail"
    tail_rows: int = 16  # up to here a decode step is bound by reading the weights (benchmarks/speculative.py)
    train: bool = False
    lr: float = 3e-4
    train_window: int = 8  # steps of rollouts the draft learns each step (benchmarks/speculative_training.py)
    force: bool = False

    @classmethod
    def parse(cls, spec: Any) -> "SpeculativeConfig":
        """``spec`` as ``rollout.engine.speculative`` holds it; a ValueError names what is wrong."""
        if not isinstance(spec, dict):
            raise ValueError(f"speculative: expected a mapping with draft and num_tokens, got {spec!r}")
        known = {"draft", "num_tokens", "when", "tail_rows", "train", "lr", "train_window", "force"}
        if unknown := sorted(set(spec) - known):
            raise ValueError(f"speculative: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        draft = spec.get("draft")
        if draft == "mtp":
            draft = {"mtp": True}
        elif not isinstance(draft, dict) or len(draft) != 1 or next(iter(draft)) not in ("path", "build"):
            raise ValueError(f"speculative.draft: expected {{path: DIR}} (a model with the target's tokenizer), "
                             f"{{build: {{...}}}} (the target's architecture, smaller) or mtp (a multi-token-"
                             f"prediction head on the target), got {draft!r}")
        if "mtp" in draft:
            pass
        elif "build" in draft:
            build = draft["build"]
            if not isinstance(build, dict):
                raise ValueError(f"speculative.draft.build: expected a mapping of {', '.join(BUILD_FIELDS)}, "
                                 f"got {build!r}")
            if bad := sorted(set(build) - set(BUILD_FIELDS)):
                raise ValueError(f"speculative.draft.build: unknown field(s) {', '.join(bad)}; a draft takes the "
                                 f"target's architecture and vocabulary and may change {', '.join(BUILD_FIELDS)}")
            for name, value in build.items():
                if not _positive_int(value):
                    raise ValueError(f"speculative.draft.build.{name}: expected an integer >= 1, got {value!r}")
        elif not isinstance(draft["path"], str) or not draft["path"]:
            raise ValueError(f"speculative.draft.path: expected a model directory, got {draft['path']!r}")
        out = cls(draft=dict(draft), **{k: spec[k] for k in ("num_tokens", "when", "tail_rows", "train", "lr",
                                                                       "train_window", "force") if k in spec})
        if not _positive_int(out.num_tokens) or out.num_tokens > 16:
            raise ValueError(f"speculative.num_tokens: expected an integer in [1, 16], got {out.num_tokens!r}")
        if out.when not in WHEN:
            raise ValueError(f"speculative.when: expected one of {', '.join(WHEN)}, got {out.when!r}")
        if not _positive_int(out.tail_rows):
            raise ValueError(f"speculative.tail_rows: expected an integer >= 1, got {out.tail_rows!r}")
        if not _positive_int(out.train_window):
            raise ValueError(f"speculative.train_window: expected an integer >= 1, got {out.train_window!r}")
        if isinstance(out.lr, bool) or not isinstance(out.lr, (int, float)) or not 0 < out.lr < 1:
            raise ValueError(f"speculative.lr: expected a learning rate in (0, 1), got {out.lr!r}")
        for name in ("train", "force"):
            if not isinstance(getattr(out, name), bool):
                raise ValueError(f"speculative.{name}: expected true or false, got {getattr(out, name)!r}")
        return out

    def active(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` rows speculates."""
        return self.when == "always" or rows <= self.tail_rows


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_draft(config: SpeculativeConfig, model_path: str, target_config: Any = None,
                target_vocab: dict[str, int] | None = None) -> None:
    """A ValueError naming what makes ``config.draft`` unfit for the target at ``model_path``: a draft directory
    that is not a model, or whose vocabulary or tokenizer is not the target's; a built draft for a vision-language
    target. ``target_config``/``target_vocab``: the target's, when the caller has them loaded."""
    import os

    from miles.models import hf

    target_config = target_config if target_config is not None else hf.load_model_config(model_path)
    text = target_config.get_text_config()
    if "path" not in config.draft:
        if text is not target_config:  # a vision-language model
            raise ValueError("speculative.draft: a vision-language target takes a text draft model from a directory "
                             "({path: DIR}, with the target's tokenizer); it proposes from the text, the image "
                             "placeholders in place of the images")
        return
    path = config.draft["path"]
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"speculative.draft.path {path!r} is not an HF model directory (no config.json there)")
    size, target_size = int(hf.load_model_config(path).get_text_config().vocab_size), int(text.vocab_size)
    if size != target_size:
        raise ValueError(f"speculative.draft.path {path}: its vocabulary has {size} tokens, the target's "
                         f"{target_size}: a draft must use the target's tokenizer")
    try:
        vocab = hf.load_tokenizer(path).get_vocab()
    except (OSError, ValueError):
        return  # a directory without a tokenizer: the vocabulary's size is what can be checked
    if vocab != (target_vocab if target_vocab is not None else hf.load_tokenizer(model_path).get_vocab()):
        raise ValueError(f"speculative.draft.path {path}: its tokenizer is not the target's (a draft must propose "
                         f"the target's token ids)")


def draft_config(target_config: Any, build: dict[str, int]) -> Any:
    """The target's text config with ``build``'s sizes (a draft of the same architecture and vocabulary)."""
    config = target_config.get_text_config().__class__.from_dict(target_config.get_text_config().to_dict())
    for name, value in build.items():
        setattr(config, _CONFIG_NAMES.get(name, name), value)
    return config


def pays(target_params: int, draft_params: int, num_tokens: int, acceptance: float = 0.7) -> tuple[bool, float]:
    """Whether speculation can be faster than plain decoding for a weight-bound target, and the speed-up it
    would give at ``acceptance`` per proposal: the tokens a step yields over its cost, one target forward of
    ``num_tokens + 1`` tokens (about one of one token when bound by reading the weights) and ``num_tokens + 1``
    draft forwards, each with :data:`FORWARD_OVERHEAD_PARAMS` of fixed cost."""
    tokens = (1 - acceptance ** (num_tokens + 1)) / (1 - acceptance)
    ratio = (draft_params + FORWARD_OVERHEAD_PARAMS) / (target_params + FORWARD_OVERHEAD_PARAMS)
    speedup = tokens / (1 + (num_tokens + 1) * ratio)
    return speedup > 1.0, speedup


def draft_distribution(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                       top_k: torch.Tensor) -> torch.Tensor:
    """The probabilities a token is drawn with (``[..., V]``; settings ``[...]``): temperature, then top-k and
    top-p, as plain sampling draws; a greedy row (temperature 0) is one-hot at its argmax."""
    drawn = truncated_logits(scaled_logits(logits, temperature), temperature, top_p, top_k).softmax(dim=-1)
    greedy = temperature == 0
    if bool(greedy.any()):
        one_hot = torch.zeros_like(drawn).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        drawn = torch.where(greedy.unsqueeze(-1), one_hot, drawn)
    return drawn


def accept(p: torch.Tensor, q: torch.Tensor, proposals: torch.Tensor,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's rule for each row.

    ``p`` ``[B, k + 1, V]``: the target's distributions after the pending token and after each proposal; ``q``
    ``[B, k, V]``: the draft's, from which ``proposals`` ``[B, k]`` were drawn. Returns the proposals kept
    (``[B]``, 0..k, a prefix) and the token that follows them (``[B]``): drawn from ``max(0, p - q)``
    renormalised at the first refused one, from the target's last distribution when all are kept.
    """
    batch, k = proposals.shape
    rows = torch.arange(batch, device=p.device)
    p_of = p[:, :k].gather(-1, proposals.unsqueeze(-1)).squeeze(-1)  # [B, k]
    q_of = q.gather(-1, proposals.unsqueeze(-1)).squeeze(-1)
    u = torch.rand((batch, k), generator=generator, device=p.device, dtype=p.dtype)
    kept = u * q_of < p_of  # with probability min(1, p/q); never where p is 0, always where p >= q > 0
    n = kept.long().cumprod(dim=1).sum(dim=1)  # [B]
    target = p[rows, n]  # [B, V]: where the next token comes from
    refused = n < k
    residual = (target - q[rows, n.clamp(max=k - 1)]).clamp(min=0)
    residual = torch.where(refused.unsqueeze(-1), residual, target)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q where the draft erred by rounding only: p itself
    residual = torch.where(empty, target, residual)
    nxt = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return n, nxt
