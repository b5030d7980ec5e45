"""Building a Megatron GPTModel from a :class:`~miles_megatron.arch.ModelSpec`, loading a rank's
weights into it, and :class:`CausalLM`: the model behind the ``model(input_ids=...).logits`` call
that Miles' training core makes.

Modules come from megatron-core's local layer spec (plain PyTorch: no Transformer Engine or Apex),
which runs on CPU and on GPU.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from miles_megatron.arch import ModelSpec, Parallel
from miles_megatron.convert import padded_vocab

__all__ = ["Parallel", "build_gpt", "load_shard", "local_state", "CausalLM"]


def transformer_config(spec: ModelSpec, parallel: Parallel, on_cpu: bool):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if spec.num_experts:
        # The all-to-all dispatcher makes a CUDA stream when built; the all-gather one runs on CPU too.
        moe["moe_token_dispatcher_type"] = "allgather" if on_cpu else "alltoall"
    return TransformerConfig(
        **spec.config,
        **moe,
        activation_func=F.silu,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        params_dtype=torch.float32,
        use_cpu_initialization=on_cpu,
        # Every weight is then loaded from the HF checkpoint, but megatron-core marks which weights are
        # split over tensor-parallel ranks (`tensor_model_parallel`, `partition_dim`) only when it
        # initialises them; the optimizer's gradient norm needs those marks.
        perform_initialization=True,
        # The fused kernels of these options need CUDA (and some Apex or Transformer Engine).
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def build_gpt(spec: ModelSpec, parallel: Parallel, device: torch.device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = transformer_config(spec, parallel, on_cpu=device.type == "cpu")
    # Per layer: dense or mixture of experts as moe_layer_freq says.
    layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(
        config, layer_spec, vocab_size=padded_vocab(spec.vocab_size, parallel.tp),
        max_sequence_length=spec.max_positions, parallel_output=False,
        share_embeddings_and_output_weights=spec.tied, position_embedding_type="rope",
        rotary_base=spec.rotary_base,
    )
    return model.to(device)


def local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters by Megatron name (without megatron's ``_extra_state`` entries)."""
    return {name: tensor for name, tensor in model.state_dict().items()
            if not name.endswith("_extra_state") and isinstance(tensor, torch.Tensor)}


def load_shard(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy a rank's converted weights into its model; every parameter must be covered exactly."""
    own = local_state(model)
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or unexpected:
        raise ValueError(f"converted weights do not fit the Megatron model: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    with torch.no_grad():
        for name, tensor in own.items():
            if tensor.shape != weights[name].shape:
                raise ValueError(f"{name}: the model has shape {tuple(tensor.shape)}, the converted weight "
                                 f"{tuple(weights[name].shape)}")
            tensor.copy_(weights[name])


class CausalLM(torch.nn.Module):
    """A GPTModel called like an HF causal LM: ``model(input_ids=ids).logits`` is ``[B, L, vocab]``.

    Rows are right-padded and attention is causal. With ``packed(lengths)`` active, the rows' real
    tokens are run as one packed sequence (a block-diagonal causal mask and positions restarting
    per row), so padding costs no compute; the logits come back in the padded layout.

    With ``same_shape_group`` (the expert-parallel group), every forward pass first agrees on the
    largest input shape within that group and pads to it: megatron-core's all-gather token
    dispatcher (the one that runs on CPU) gathers equal-sized token blocks from each rank.
    """

    def __init__(self, gpt: torch.nn.Module, vocab_size: int, same_shape_group: Any = None) -> None:
        super().__init__()
        self.gpt, self.vocab_size, self.same_shape_group = gpt, vocab_size, same_shape_group
        self._lengths: torch.Tensor | None = None

    def _agreed(self, *sizes: int) -> list[int]:
        if self.same_shape_group is None:
            return list(sizes)
        import torch.distributed as dist

        agreed = torch.tensor(sizes)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.same_shape_group)
        return agreed.tolist()

    def packed(self, lengths: torch.Tensor | None) -> "_Packing":
        return _Packing(self, lengths)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        device = next(self.gpt.parameters()).device
        input_ids = input_ids.to(device)
        if self._lengths is not None:
            return SimpleNamespace(logits=self._packed_forward(input_ids, self._lengths))
        rows, width = input_ids.shape
        all_rows, all_width = self._agreed(rows, width)
        padded = torch.nn.functional.pad(input_ids, (0, all_width - width, 0, all_rows - rows))
        positions = torch.arange(all_width, device=device).expand(all_rows, -1)
        mask = torch.ones(all_width, all_width, dtype=torch.bool, device=device).triu(1)[None, None]  # True: hidden
        logits = self.gpt(padded, positions, mask)
        return SimpleNamespace(logits=logits[:rows, :width, : self.vocab_size])

    def _packed_forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        device = input_ids.device
        lengths = [int(n) for n in lengths]
        (total,) = self._agreed(sum(lengths))
        pieces = [row[:n] for row, n in zip(input_ids, lengths)]
        blocks = list(lengths)
        if total > sum(lengths):  # filler tokens, in a block of their own
            pieces.append(input_ids.new_zeros(total - sum(lengths)))
            blocks.append(total - sum(lengths))
        tokens = torch.cat(pieces)[None]
        positions = torch.cat([torch.arange(n, device=device) for n in blocks])[None]
        owner = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(blocks)])
        hidden = (owner[:, None] != owner[None, :]) | torch.ones(total, total, dtype=torch.bool, device=device).triu(1)
        packed = self.gpt(tokens, positions, hidden[None, None])[0, :, : self.vocab_size]
        out = packed.new_zeros(*input_ids.shape, self.vocab_size)
        start = 0
        for row, n in enumerate(lengths):
            out[row, :n] = packed[start: start + n]
            start += n
        return out


class _Packing:
    def __init__(self, model: CausalLM, lengths: torch.Tensor | None) -> None:
        self.model, self.lengths = model, lengths

    def __enter__(self) -> None:
        self.model._lengths = self.lengths

    def __exit__(self, *exc: object) -> None:
        self.model._lengths = None
