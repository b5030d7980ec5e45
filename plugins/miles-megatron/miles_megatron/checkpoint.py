"""Reading a backend checkpoint's weights without a training run: the ``model/`` directory that
:meth:`MegatronBackend.save_checkpoint` writes (megatron's distributed format) as HF weights."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["hf_weights_from_checkpoint"]


def hf_weights_from_checkpoint(model_dir: str, checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """HF weights (by ``transformers`` name) of ``checkpoint_dir/model``, for the architecture of
    the HF model directory ``model_dir``. Runs megatron-core in this process (a one-process world)."""
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    from miles_megatron import parallel
    from miles_megatron.arch import model_spec
    from miles_megatron.convert import megatron_to_hf, unshard
    from miles_megatron.model import Parallel, build_gpt, local_state

    parallel.init_world(0, 1)
    parallel.init_model_parallel(Parallel(), seed=0)
    spec = model_spec(AutoConfig.from_pretrained(model_dir))
    gpt = build_gpt(spec, Parallel(), torch.device("cpu"))
    gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), str(Path(checkpoint_dir) / "model")))
    return megatron_to_hf(unshard({(0, 0): local_state(gpt)}, spec), spec)
