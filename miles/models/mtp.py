"""A multi-token-prediction (MTP) head, the draft that DeepSeek-V3, GLM-4.5 and Qwen3-Next ship beside their model.

At the column of token ``t_i`` the head takes the target's last hidden state at ``i - 1`` (after its final norm) and
the target's embedding of ``t_i``, normalises each, projects their concatenation ``[embedding, hidden]`` back to the
hidden size, and runs one decoder block of the target's architecture over it; the target's output layer turns the
block's (normed) output into the distribution of ``t_{i+1}``. Chained, its own output stands in for the target's
hidden state, so one head proposes any number of tokens. The first column of a sequence has no hidden state before
it and takes zeros.

The head holds its own weights only (``enorm``, ``hnorm``, ``eh_proj`` and ``block``: the decoder layer and its
final norm); the embedding and output layer are the target's, so they follow every weight push of the policy.

Published layouts, read from the target's checkpoint (:func:`checkpoint_head`):

- DeepSeek-V3 / GLM-4.5: ``num_nextn_predict_layers`` in the config, the head as layer ``num_hidden_layers``
  (``model.layers.{N}.enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the layer's own tensors; its copies of
  the embedding and output layer, ``embed_tokens`` and ``shared_head.head``, are the target's and are not read);
- Qwen3-Next: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*``,
  ``mtp.norm``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["MultiTokenPredictor", "build_head", "checkpoint_head", "is_head_tensor", "head_names", "published_tensors",
           "LAYOUTS"]

_DEEPSEEK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_DEEPSEEK_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the target's own, copied into the layer
_DEEPSEEK_RENAME = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                    "shared_head.norm.weight": "block.norm.weight"}
LAYOUTS = ("deepseek_v3", "qwen3_next")
_QWEN3_NEXT_RENAME = {"mtp.fc.weight": "eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
                      "mtp.pre_fc_norm_hidden.weight": "hnorm.weight", "mtp.norm.weight": "block.norm.weight"}


class MultiTokenPredictor(nn.Module):
    def __init__(self, text_config: Any) -> None:
        from transformers import AutoModel

        super().__init__()
        config = text_config.__class__.from_dict(text_config.to_dict())
        config.num_hidden_layers = 1
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[-1:]
        self.block = AutoModel.from_config(config)
        self.block.embed_tokens = None  # the target's embedding is used
        norm, size = type(self.block.norm), int(config.hidden_size)
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.enorm, self.hnorm = norm(size, eps=eps), norm(size, eps=eps)
        self.eh_proj = nn.Linear(2 * size, size, bias=False)
        self.hidden_size = size

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, cache: Any = None) -> torch.Tensor:
        """The block's normed output ``[B, T, H]`` for the token ``embeds`` ``[B, T, H]`` (the target's embedding)
        and the hidden states before them ``hidden`` ``[B, T, H]``; ``attention_mask`` covers the cache's columns
        and these."""
        fused = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.block(inputs_embeds=fused, attention_mask=attention_mask, position_ids=position_ids,
                          cache=cache, use_cache=cache is not None).last_hidden_state


def build_head(target_config: Any, seed: int, dtype: torch.dtype = torch.float32) -> MultiTokenPredictor:
    """A head for the target of ``target_config`` (its text config), at random from ``seed``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return MultiTokenPredictor(target_config.get_text_config()).to(dtype)


def _config(path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config") or config


def head_names(model_path: str | Path) -> dict[str, str]:
    """The checkpoint's names of an MTP head's tensors, each with its name in :class:`MultiTokenPredictor` (the
    target's shared copies map to ""); empty when the checkpoint ships no head."""
    from safetensors import safe_open

    path = Path(model_path)
    config = _config(path)
    names: list[str] = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    layers = int(config.get("num_hidden_layers", 0))
    out: dict[str, str] = {}
    if int(config.get("num_nextn_predict_layers") or 0) >= 1:
        for name in names:
            match = _DEEPSEEK.match(name)
            if match is None or int(match.group(1)) != layers:  # further layers: heads for t+3.., not used
                continue
            rest = match.group(2)
            out[name] = "" if rest in _DEEPSEEK_SHARED else _DEEPSEEK_RENAME.get(rest, f"block.layers.0.{rest}")
    for name in names:
        if name in _QWEN3_NEXT_RENAME:
            out[name] = _QWEN3_NEXT_RENAME[name]
        elif name.startswith("mtp.layers.0."):
            out[name] = "block.layers.0." + name.removeprefix("mtp.layers.0.")
    return out


def is_head_tensor(name: str, config: dict[str, Any]) -> bool:
    """Whether ``name`` in a checkpoint of ``config`` (its config.json) is an MTP head's, not the model's."""
    if name.startswith("mtp."):
        return True
    text = config.get("text_config") or config
    match = _DEEPSEEK.match(name)
    return (match is not None and int(text.get("num_nextn_predict_layers") or 0) >= 1
            and int(match.group(1)) >= int(text.get("num_hidden_layers", 0)))


def checkpoint_head(model_path: str | Path, target_config: Any,
                    dtype: torch.dtype = torch.float32) -> MultiTokenPredictor | None:
    """The MTP head the checkpoint in ``model_path`` ships (float, or dequantized from its stored form), or None
    when it ships none. A head whose tensors do not make the target's block is a ValueError naming them."""
    from miles.precision.checkpoint import read_float_weights

    names = head_names(model_path)
    if not names:
        return None
    weights = read_float_weights(model_path)
    head = MultiTokenPredictor(target_config.get_text_config())
    state = {new: weights[old] for old, new in names.items() if new and old in weights}
    if "block.layers.0.mlp.experts.gate_up_proj" in head.state_dict():
        from miles.precision.experts import fuse_per_expert

        state = fuse_per_expert(state, head.state_dict())
    expected = head.state_dict()
    if missing := sorted(set(expected) - set(state)):
        raise ValueError(f"{model_path}: its MTP head misses {', '.join(missing[:6])} (a head of the target's "
                         f"architecture, one decoder layer)")
    if extra := sorted(set(state) - set(expected)):
        raise ValueError(f"{model_path}: its MTP head holds tensors the target's decoder layer has no place for: "
                         f"{', '.join(extra[:6])}")
    if bad := [n for n, t in state.items() if tuple(t.shape) != tuple(expected[n].shape)]:
        raise ValueError(f"{model_path}: its MTP head's {bad[0]} is {tuple(state[bad[0]].shape)}, the target's "
                         f"architecture makes it {tuple(expected[bad[0]].shape)}")
    head.load_state_dict(state)
    return head.to(dtype)


def published_tensors(head: MultiTokenPredictor, num_hidden_layers: int,
                      layout: str = "deepseek_v3") -> dict[str, torch.Tensor]:
    """``head``'s weights under the names a checkpoint of ``layout`` gives them (:data:`LAYOUTS`), without the
    target's shared embedding and output layer; the DeepSeek-V3 layout also needs ``num_nextn_predict_layers: 1``
    in the config."""
    if layout not in LAYOUTS:
        raise ValueError(f"MTP layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    renames = ({new: old for old, new in _QWEN3_NEXT_RENAME.items()} if layout == "qwen3_next" else
               {new: f"model.layers.{num_hidden_layers}.{old}" for old, new in _DEEPSEEK_RENAME.items()})
    prefix = "mtp.layers.0." if layout == "qwen3_next" else f"model.layers.{num_hidden_layers}."
    out = {}
    for name, tensor in head.state_dict().items():
        out[renames.get(name) or prefix + name.removeprefix("block.layers.0.")] = tensor.detach().clone()
    return out
