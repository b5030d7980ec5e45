"""The architecture map: how an HF causal LM's config and weights correspond to a Megatron GPTModel.

Everything per architecture is data in :data:`ARCHS`, keyed by the HF ``model_type``:

- ``config``: Megatron ``TransformerConfig`` field <- HF config field (``None``: the field is fixed
  by ``fixed`` instead);
- ``fixed``: Megatron fields with one value for the architecture;
- ``rules``: one :class:`Rule` per Megatron parameter, naming the HF parameter(s) it is made of, how
  they are joined (``join``) and along which dimension tensor parallelism splits it (``tp_dim``).

Names use ``{layer}`` for the layer index and ``{expert}`` for the (global) expert index. The HF side
uses the names of ``transformers``' in-memory ``state_dict`` (what the ``torch`` backend exports), in
which a Qwen3-MoE layer's experts are two stacked tensors; ``transformers`` writes them per expert
on disk itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Rule", "Arch", "ARCHS", "ModelSpec", "Parallel", "arch_for", "model_spec"]

JOINS = ("copy", "qkv", "gate_up", "stacked")


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter and the HF parameter(s) it holds.

    ``join``: ``copy`` (the same tensor), ``qkv`` (q, k and v projections interleaved per query
    group, Megatron's ``linear_qkv``), ``gate_up`` (gate then up projection stacked along the output
    dimension, Megatron's gated ``linear_fc1``), ``stacked`` (expert ``{expert}`` is entry
    ``{expert}`` of an HF tensor that stacks all experts along dimension 0). ``tp_dim``: the
    dimension split over tensor-parallel ranks (0: column-parallel, 1: row-parallel), None when
    every rank holds it whole. ``vocab``: dimension 0 is the vocabulary (padded for tensor parallelism).
    ``where``: which layers have it (``all``, ``dense`` or ``moe``; ``model`` for the ones outside layers).
    ``tp_grad_sum``: whole on every tensor-parallel rank but applied to that rank's heads only, so its
    gradient is the sum over those ranks (Qwen3's per-head q and k norms).
    """

    megatron: str
    hf: tuple[str, ...]
    join: str = "copy"
    tp_dim: int | None = None
    where: str = "all"
    vocab: bool = False
    tp_grad_sum: bool = False

    def __post_init__(self) -> None:
        if self.join not in JOINS:
            raise ValueError(f"Rule {self.megatron}: join must be one of {JOINS}, got {self.join!r}")


@dataclass(frozen=True)
class Arch:
    config: dict[str, str]
    fixed: dict[str, Any]
    rules: tuple[Rule, ...]
    moe_config: dict[str, str] = field(default_factory=dict)
    moe_fixed: dict[str, Any] = field(default_factory=dict)


_L = "model.layers.{layer}."
_M = "decoder.layers.{layer}."

_QWEN3_RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), tp_dim=0, where="model", vocab=True),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), where="model"),
    Rule("output_layer.weight", ("lm_head.weight",), tp_dim=0, where="untied", vocab=True),
    Rule(_M + "input_layernorm.weight", (_L + "input_layernorm.weight",)),
    Rule(_M + "self_attention.linear_qkv.weight",
         (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
         join="qkv", tp_dim=0),
    Rule(_M + "self_attention.q_layernorm.weight", (_L + "self_attn.q_norm.weight",), tp_grad_sum=True),
    Rule(_M + "self_attention.k_layernorm.weight", (_L + "self_attn.k_norm.weight",), tp_grad_sum=True),
    Rule(_M + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",), tp_dim=1),
    Rule(_M + "pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",)),
    Rule(_M + "mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
         join="gate_up", tp_dim=0, where="dense"),
    Rule(_M + "mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",), tp_dim=1, where="dense"),
    # Mixture of experts (local SequentialMLP experts; expert tensor parallelism is 1).
    Rule(_M + "mlp.router.weight", (_L + "mlp.gate.weight",), where="moe"),
    Rule(_M + "mlp.experts.local_experts.{expert}.linear_fc1.weight", (_L + "mlp.experts.gate_up_proj",),
         join="stacked", where="moe"),
    Rule(_M + "mlp.experts.local_experts.{expert}.linear_fc2.weight", (_L + "mlp.experts.down_proj",),
         join="stacked", where="moe"),
)

_QWEN3_CONFIG = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "kv_channels": "head_dim",
    "ffn_hidden_size": "intermediate_size",
    "layernorm_epsilon": "rms_norm_eps",
}

_QWEN3_FIXED = {
    "normalization": "RMSNorm",
    "gated_linear_unit": True,
    "add_bias_linear": False,
    "qk_layernorm": True,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}

ARCHS: dict[str, Arch] = {
    "qwen3": Arch(_QWEN3_CONFIG, _QWEN3_FIXED, _QWEN3_RULES),
    "qwen3_moe": Arch(
        _QWEN3_CONFIG, _QWEN3_FIXED, _QWEN3_RULES,
        moe_config={"num_moe_experts": "num_experts", "moe_router_topk": "num_experts_per_tok",
                    "moe_ffn_hidden_size": "moe_intermediate_size"},
        # Softmax over all experts then the top k, renormalised only with norm_topk_prob (see model_spec).
        # No auxiliary loss: the policy's loss is the RL loss alone, as with the torch backend.
        moe_fixed={"moe_router_score_function": "softmax", "moe_router_load_balancing_type": "none",
                   "moe_aux_loss_coeff": 0.0, "moe_grouped_gemm": False, "expert_tensor_parallel_size": 1},
    ),
}


@dataclass(frozen=True)
class Parallel:
    """Model-parallel sizes (data parallelism is what is left of the world size)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1


def arch_for(model_type: str) -> Arch:
    from miles.train.api import ConfigError

    if model_type not in ARCHS:
        raise ConfigError(f"backend megatron: the model's config.json has model_type {model_type!r}, which the "
                          f"architecture map does not cover; known: {', '.join(sorted(ARCHS))}")
    return ARCHS[model_type]


@dataclass(frozen=True)
class ModelSpec:
    """What conversion and sharding need to know about one model (read from its HF config)."""

    arch: Arch
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    tied: bool
    rotary_base: float
    max_positions: int
    config: dict[str, Any]  # TransformerConfig keyword arguments

    def layer_kind(self, layer: int) -> str:
        return "moe" if layer in self.moe_layers else "dense"

    def rules_for(self, layer: int | None) -> list[Rule]:
        """The rules of one layer (``None``: those outside the layers)."""
        if layer is None:
            return [r for r in self.arch.rules if r.where == "model" or (r.where == "untied" and not self.tied)]
        kind = self.layer_kind(layer)
        return [r for r in self.arch.rules if r.where in ("all", kind)]


def _rope_theta(hf_config: Any) -> float:
    from miles.train.api import ConfigError

    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(f"backend megatron: rope_type {rope_type!r} is not mapped (only 'default' RoPE)")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ConfigError("backend megatron: the model's config has no rope_theta")
    return float(theta)


def model_spec(hf_config: Any) -> ModelSpec:
    """The :class:`ModelSpec` of an HF config (``transformers.PretrainedConfig``)."""
    from miles.train.api import ConfigError

    arch = arch_for(hf_config.model_type)
    if getattr(hf_config, "use_sliding_window", False):
        raise ConfigError("backend megatron: sliding-window attention (use_sliding_window) is not mapped")
    if getattr(hf_config, "attention_bias", False):
        raise ConfigError("backend megatron: attention_bias=true is not mapped (Qwen3 has no attention biases)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"backend megatron: hidden_act {hf_config.hidden_act!r} is not mapped (only silu)")
    config = {name: getattr(hf_config, hf_name) for name, hf_name in arch.config.items()}
    config.update(arch.fixed)
    layers = hf_config.num_hidden_layers
    moe_layers: tuple[int, ...] = ()
    experts = 0
    if arch.moe_config:
        config.update({name: getattr(hf_config, hf_name) for name, hf_name in arch.moe_config.items()})
        config.update(arch.moe_fixed)
        experts = hf_config.num_experts
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense_only = set(getattr(hf_config, "mlp_only_layers", None) or ())
        moe_layers = tuple(i for i in range(layers) if i not in dense_only and experts > 0 and (i + 1) % step == 0)
        config["moe_layer_freq"] = [1 if i in moe_layers else 0 for i in range(layers)]
        # Top k of a softmax over all experts; renormalising those k equals a softmax over the k logits.
        config["moe_router_pre_softmax"] = not getattr(hf_config, "norm_topk_prob", False)
        if not moe_layers:
            for name in (*arch.moe_config, *arch.moe_fixed, "moe_layer_freq", "moe_router_pre_softmax"):
                config.pop(name, None)
    return ModelSpec(
        arch=arch, num_layers=layers, moe_layers=moe_layers, num_experts=experts,
        num_heads=hf_config.num_attention_heads, num_query_groups=hf_config.num_key_value_heads,
        head_dim=hf_config.head_dim, vocab_size=hf_config.vocab_size, tied=bool(hf_config.tie_word_embeddings),
        rotary_base=_rope_theta(hf_config), max_positions=hf_config.max_position_embeddings, config=config,
    )
