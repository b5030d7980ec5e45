"""Mixture-of-experts routing, seen and steered from outside the model: used by the rollout engine (to
record the experts each token was sent to) and by the trainer (to replay them: R3, and for the router's
metrics and load-balancing loss).

A model's MoE layers are found by their router modules (:data:`ROUTERS`: transformers' Qwen3-MoE
``Qwen3MoeTopKRouter``). Inside :func:`routing`, each router's forward is replaced by one that computes
the same thing (softmax over the router logits, top-k, renormalised when ``norm_topk_prob``) and
optionally

- *records* the chosen expert ids (and keeps the router logits, with their graph, for the aux loss);
- *replays* given expert ids: where a token has recorded ids, they replace the router's own top-k and
  the gate weights are the router's probabilities of those experts (so the router still learns);
  tokens without ids (marked -1) are routed as usual.

Routing data is ``[tokens, num_layers * top_k]`` expert ids, one row per input token, in the order
(layer, slot); layers without experts hold -1. The engine sends it as SGLang does: ``meta_info
["routed_experts"]``, the base64 of little-endian int32 values ``[tokens, num_layers, top_k]`` for
every token the request fed through the model (prompt, then outputs but the last). Samples keep it
compactly (:func:`compact`): one byte per id when the model has at most 255 experts.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from miles.lazy import lazy_module

np = lazy_module("numpy")
torch = lazy_module("torch")
F = lazy_module("torch.nn.functional")

__all__ = ["MoELayout", "moe_layout", "routing", "RoutingRecord", "encode_routed_experts",
           "decode_routed_experts", "compact", "expand", "NO_EXPERT"]

ROUTERS = ("Qwen3MoeTopKRouter",)  # router classes whose forward :func:`routing` knows how to reproduce
NO_EXPERT = -1


@dataclass(frozen=True)
class MoELayout:
    num_layers: int  # decoder layers (dense ones included: their ids are -1)
    top_k: int
    num_experts: int
    routers: dict[int, torch.nn.Module] = field(compare=False)  # decoder layer index -> its router

    @property
    def width(self) -> int:
        """Ids per token."""
        return self.num_layers * self.top_k


def moe_layout(model: torch.nn.Module) -> MoELayout | None:
    """The MoE layers of an HF causal LM (None for a dense model)."""
    config = getattr(model, "config", None)
    routers: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if type(module).__name__ in ROUTERS:
            routers[_layer_index(name)] = module
    if not routers or config is None:
        return None
    first = next(iter(routers.values()))
    return MoELayout(int(config.num_hidden_layers), int(first.top_k), int(first.num_experts), routers)


def _layer_index(name: str) -> int:
    parts = name.split(".")
    for before, value in zip(parts, parts[1:]):
        if before == "layers" and value.isdigit():
            return int(value)
    raise ValueError(f"cannot tell which decoder layer the router {name!r} belongs to")


@dataclass
class RoutingRecord:
    """What the routers did in one forward pass, by decoder layer: expert ids ``[tokens, top_k]`` and
    router logits ``[tokens, num_experts]`` (tokens: the batch flattened, padding included)."""

    layout: MoELayout
    ids: dict[int, torch.Tensor] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)

    def routed(self, batch: int) -> torch.Tensor:
        """``[batch, tokens, num_layers * top_k]`` ids (-1 for dense layers)."""
        layout = self.layout
        first = next(iter(self.ids.values()))
        out = first.new_full((first.shape[0], layout.num_layers, layout.top_k), NO_EXPERT)
        for layer, ids in self.ids.items():
            out[:, layer] = ids
        return out.reshape(batch, -1, layout.width)

    def load_stats(self, token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Over the tokens where ``token_mask`` (flattened like the batch) is true, averaged over MoE layers:
        the load-balancing loss (``num_experts x sum_e f_e P_e``, ``f_e`` the share of token->expert assignments
        that went to expert ``e``, ``P_e`` its mean router probability; 1.0 when balanced, differentiable) and
        the largest share one expert took (``1/num_experts`` when balanced, a float)."""
        mask = token_mask.reshape(-1).to(torch.bool)
        n_experts, aux, top = self.layout.num_experts, [], []
        for layer, logits in self.logits.items():
            ids = self.ids[layer][mask]
            if ids.numel() == 0:
                continue
            share = torch.bincount(ids.reshape(-1), minlength=n_experts).float() / ids.numel()
            probs = torch.softmax(logits[mask].float(), dim=-1).mean(dim=0)
            aux.append(n_experts * (share.to(probs.device) * probs).sum())
            top.append(share.max())
        if not aux:
            zero = next(iter(self.logits.values())).new_zeros((), dtype=torch.float)
            return zero, zero.detach()
        return torch.stack(aux).mean(), torch.stack(top).mean().detach()


@contextlib.contextmanager
def routing(model: torch.nn.Module, *, replay: torch.Tensor | None = None, record: bool = True,
            keep_logits: bool = False, layout: MoELayout | None = None) -> Iterator[RoutingRecord | None]:
    """Within the block, the model's routers record their choices (and, with ``keep_logits``, their logits)
    and follow ``replay`` (``[batch, tokens, num_layers * top_k]`` ids of the forward's inputs, -1 where a
    token is routed as usual). Yields None for a dense model (``replay`` must then be None). ``layout``: the
    model's, when the caller has it already."""
    layout = layout or moe_layout(model)
    if layout is None:
        if replay is not None:
            raise ValueError("routing replay needs a mixture-of-experts model; this model has no expert router")
        yield None
        return
    if replay is not None and replay.shape[-1] != layout.width:
        raise ValueError(f"routed_experts holds {replay.shape[-1]} expert ids per token, but this model routes "
                         f"{layout.num_layers} layers x top-{layout.top_k} = {layout.width}: the samples come from "
                         f"another model")
    record_ = RoutingRecord(layout)
    per_layer = None
    if replay is not None:
        per_layer = replay.reshape(-1, layout.num_layers, layout.top_k).long()
    patched = []
    try:
        for layer, router in layout.routers.items():
            router.forward = _routed_forward(router, layer, per_layer, record_ if record else None, keep_logits)
            patched.append(router)
        yield record_
    finally:
        for router in patched:
            del router.forward


def _routed_forward(router: torch.nn.Module, layer: int, replay: torch.Tensor | None,
                    record: RoutingRecord | None, keep_logits: bool):
    def forward(hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_values, top_ids = torch.topk(probs, router.top_k, dim=-1)
        if replay is not None:
            given = replay[:, layer].to(top_ids.device)
            if given.shape[0] != top_ids.shape[0]:
                raise ValueError(f"routing replay: {given.shape[0]} tokens of routed_experts for a forward pass of "
                                 f"{top_ids.shape[0]} tokens")
            use = (given >= 0).all(dim=-1, keepdim=True)
            top_ids = torch.where(use, given, top_ids)
            top_values = probs.gather(-1, top_ids)
        if router.norm_topk_prob:
            top_values = top_values / top_values.sum(dim=-1, keepdim=True)
        if record is not None:
            record.ids[layer] = top_ids.detach()
            if keep_logits:
                record.logits[layer] = logits
        return logits, top_values.to(logits.dtype), top_ids
    return forward


# -- routing data on the wire and in samples ----------------------------------------------------------


def encode_routed_experts(ids: np.ndarray | torch.Tensor) -> str:
    """``[tokens, num_layers, top_k]`` (or ``[tokens, num_layers * top_k]``) ids as SGLang sends them."""
    array = ids.cpu().numpy() if torch.is_tensor(ids) else np.asarray(ids)
    return base64.b64encode(np.ascontiguousarray(array, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(data: str, tokens: int) -> np.ndarray:
    """``[tokens, ids per token]`` int32 from ``meta_info["routed_experts"]`` of an answer that fed ``tokens``
    tokens through the model. A ValueError says what does not fit."""
    try:
        values = np.frombuffer(base64.b64decode(data, validate=True), dtype="<i4")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"meta_info.routed_experts: expected base64 of int32 values, got {str(data)[:40]!r}") from exc
    if tokens <= 0 or values.size % tokens:
        raise ValueError(f"meta_info.routed_experts: {values.size} expert ids do not split over the {tokens} tokens "
                         f"the request fed through the model")
    return values.reshape(tokens, -1)


def compact(ids: np.ndarray) -> np.ndarray:
    """Ids in one byte each when every id is below 255 (two bytes below 65535), with -1 stored as the type's
    largest value: the form samples keep (Qwen3-MoE's 128 experts: one byte per id)."""
    top = int(ids.max()) if ids.size else 0
    dtype = np.uint8 if top < 255 else np.uint16 if top < 65535 else np.int64
    out = ids.astype(dtype)
    if dtype is not np.int64:
        out[ids < 0] = np.iinfo(dtype).max
    return out


def expand(ids: np.ndarray) -> np.ndarray:
    """The signed ids (-1 where none) of :func:`compact`'s form."""
    out = ids.astype(np.int32)
    if ids.dtype in (np.uint8, np.uint16):
        out[ids == np.iinfo(ids.dtype).max] = NO_EXPERT
    return out
