"""Models and tokenizers without downloads: load an HF-format directory, or build a small one.

Built models are random-init ``transformers`` models saved with safetensors, so that
``AutoModelForCausalLM.from_pretrained`` loads them like any other checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from miles.errors import ConfigError
from miles.models.sampling import distribution_logits

__all__ = ["build_char_tokenizer", "build_model_dir", "chat_template_problem", "context_length", "exact_logprobs",
           "load_model", "load_tokenizer", "read_chat_template", "save_pretrained", "set_chat_template"]

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


def build_char_tokenizer(alphabet: str, special_tokens: Sequence[str] = (), added_tokens: Sequence[str] = (),
                         chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """A tokenizer with one token per character of ``alphabet`` plus ``<pad>``, ``<eos>``, ``<unk>``.

    ``special_tokens`` (e.g. ``<|im_start|>``, dropped when decoding with ``skip_special_tokens``) and
    ``added_tokens`` (e.g. ``<tool_call>``, kept in decoded text) are one token each. ``chat_template``
    is a Jinja file, or the name of one shipped in ``miles/templates`` (``chatml_tools``).
    """
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))  # unique, order kept
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # newlines too, one by one
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    if special_tokens:
        fast.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if added_tokens:
        fast.add_tokens(list(added_tokens))
    if chat_template:
        set_chat_template(fast, chat_template, "model.tokenizer.chat_template")
    return fast


TEMPLATES_DIR = Path(__file__).parent.parent / "templates"


def read_chat_template(name_or_path: str, where: str = "model.tokenizer.chat_template") -> str:
    """The Jinja text of a chat template file, or of one shipped with Miles (by name, without ``.jinja``), compiled
    once as ``apply_chat_template`` compiles it: a syntax error or an unknown filter or test is a ConfigError naming
    ``where``, the file and the line, before anything renders with it."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    path = _template_path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja")))
        raise ConfigError(f"{where}: {name_or_path!r} is neither a file nor a shipped "
                          f"template ({known})")
    text = path.read_text()
    try:
        _compile_jinja_template(text)
    except TemplateSyntaxError as exc:  # an unknown filter or test too (TemplateAssertionError)
        line, what = chat_template_problem(exc)
        raise ConfigError(f"{where}: chat template {str(path)!r}, line {line}: {what}") from None
    return text


def set_chat_template(tokenizer: PreTrainedTokenizerBase, name_or_path: str, where: str) -> None:
    """Make :func:`read_chat_template`'s template the tokenizer's, rendered once on the least any chat has (one user
    message and the generation prompt): a template that raises there (``raise_exception``, or an error in its own
    code, such as adding a number to a string) is a ConfigError naming ``where``, the file and the line, at start
    rather than in the middle of a run."""
    tokenizer.chat_template = read_chat_template(name_or_path, where)
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True,
                                      tokenize=False)
    except Exception as exc:
        problem = chat_template_problem(exc)
        if problem is None:  # not the template's own code: a bug elsewhere, whose traceback is wanted
            raise
        raise ConfigError(f"{where}: chat template {str(_template_path(name_or_path))!r}, line {problem[0]}: "
                          f"{problem[1]} (rendering a conversation of one user message)") from None


def _template_path(name_or_path: str) -> Path:
    """The file of a shipped template's name, else the path as given."""
    shipped = TEMPLATES_DIR / f"{name_or_path}.jinja"
    return shipped if shipped.is_file() else Path(name_or_path)


def chat_template_problem(exc: BaseException) -> tuple[int, str] | None:
    """``(line, what went wrong)`` for an error that compiling or rendering a chat template raised (Jinja reports a
    syntax error's line; a render error has the template's own frame, ``<template>``, in its traceback); None when
    ``exc`` did not come from a template."""
    from jinja2 import TemplateError, TemplateSyntaxError

    if isinstance(exc, TemplateSyntaxError):
        return exc.lineno, str(exc.message)
    line, tb = None, exc.__traceback__
    while tb is not None:  # the innermost frame of the template (a macro's, when one raised)
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None:
        return None
    return line, (f"it raised {str(exc)!r}" if type(exc) is TemplateError else f"{type(exc).__name__}: {exc}")


def build_tokenizer(cfg) -> PreTrainedTokenizerBase:
    """The tokenizer a ``model.tokenizer`` section describes: a char tokenizer, or a real BPE vocabulary
    (:mod:`miles.models.vocabularies`) with the special and added tokens one token each."""
    if cfg.kind == "char":
        return build_char_tokenizer(cfg.alphabet, cfg.special_tokens, cfg.added_tokens, cfg.chat_template)
    from miles.models.vocabularies import build_bpe_tokenizer

    try:
        tokenizer = build_bpe_tokenizer(cfg.kind, list(cfg.special_tokens), max_ranks=int(cfg.max_ranks))
    except ValueError as exc:
        raise ConfigError(f"model.tokenizer: {exc}") from exc
    if cfg.added_tokens:
        tokenizer.add_tokens([t for t in cfg.added_tokens if t not in tokenizer.get_vocab()])
    if cfg.chat_template:
        set_chat_template(tokenizer, cfg.chat_template, "model.tokenizer.chat_template")
    return tokenizer


def _shared_fields(vocab_size: int, tokenizer: PreTrainedTokenizerBase, build) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=build.hidden_size,
        num_hidden_layers=build.num_layers,
        num_attention_heads=build.num_heads,
        num_key_value_heads=build.num_kv_heads,
        head_dim=build.head_dim,
        intermediate_size=build.intermediate_size,
        max_position_embeddings=build.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def _qwen3_config(vocab_size: int, tokenizer: PreTrainedTokenizerBase, build) -> object:
    from transformers import Qwen3Config

    return Qwen3Config(**_shared_fields(vocab_size, tokenizer, build))


def _qwen3_moe_config(vocab_size: int, tokenizer: PreTrainedTokenizerBase, build) -> object:
    """Qwen3-MoE: every decoder layer's MLP is ``num_experts`` experts of width ``moe_intermediate_size``, of which a
    router picks ``num_experts_per_tok`` per token."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_shared_fields(vocab_size, tokenizer, build),
                          moe_intermediate_size=build.moe_intermediate_size, num_experts=build.num_experts,
                          num_experts_per_tok=build.num_experts_per_tok, norm_topk_prob=build.norm_topk_prob)


VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")  # one special token each


def _qwen2_5_vl_config(vocab_size: int, tokenizer: PreTrainedTokenizerBase, build) -> object:
    """Qwen2.5-VL: the text decoder of ``build`` with multimodal RoPE, and a vision tower of ``vision_depth``
    blocks whose ``vision_patch_size`` patches, merged 2x2, become one token each. The tokenizer must hold
    :data:`VISION_TOKENS` (``model.tokenizer.special_tokens``)."""
    from transformers import Qwen2_5_VLConfig

    vocab = tokenizer.get_vocab()
    missing = [t for t in VISION_TOKENS if t not in vocab]
    if missing:
        raise ConfigError(f"model.build.arch qwen2_5_vl: the tokenizer lacks {', '.join(missing)}; add them to "
                          f"model.tokenizer.special_tokens")
    if build.head_dim * build.num_heads != build.hidden_size:
        raise ConfigError(f"model.build: qwen2_5_vl takes head_dim = hidden_size / num_heads; got head_dim "
                          f"{build.head_dim} with hidden_size {build.hidden_size} and {build.num_heads} heads")
    half = build.head_dim // 2  # rotary frequencies, split over time, height and width
    text = {**_shared_fields(vocab_size, tokenizer, build),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]}}
    text.pop("head_dim")
    start, pad, end = (vocab[t] for t in VISION_TOKENS)
    vision = dict(depth=build.vision_depth, hidden_size=build.vision_hidden_size,
                  intermediate_size=2 * build.vision_hidden_size, num_heads=build.vision_num_heads,
                  out_hidden_size=build.hidden_size, patch_size=build.vision_patch_size, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=4 * build.vision_patch_size,
                  fullatt_block_indexes=[build.vision_depth - 1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=pad, video_token_id=pad,
                            vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=True)


_ARCHS = {"qwen3": _qwen3_config, "qwen3_moe": _qwen3_moe_config, "qwen2_5_vl": _qwen2_5_vl_config}


def _model_class(config) -> type:
    """The Auto class that loads ``config``'s model: vision-language models are image-text-to-text."""
    if getattr(config, "vision_config", None) is not None:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_model_config(path: str | Path) -> object:
    """The model config of the checkpoint at ``path``."""
    return AutoConfig.from_pretrained(_check_dir(path))


def model_on_meta(path: str | Path) -> PreTrainedModel:
    """The model of the checkpoint at ``path`` on the meta device: its modules and shapes, nothing allocated or
    read (a stored form's quantization config left out)."""
    config = load_model_config(path)
    if getattr(config, "quantization_config", None):
        del config.quantization_config
    with torch.device("meta"):
        return _model_class(config).from_config(config)


def causal_lm_from_config(config, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A random-init causal LM of ``config`` (the caller seeds torch)."""
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def build_model_dir(build, tokenizer_cfg, out_dir: str | Path, seed: int) -> Path:
    """Build a random-init model and a char tokenizer from config sections and save them."""
    if build.arch not in _ARCHS:
        raise ConfigError(f"model.build.arch: unknown architecture {build.arch!r}; known: {', '.join(_ARCHS)}")
    tokenizer = build_tokenizer(tokenizer_cfg)
    config = _ARCHS[build.arch](len(tokenizer), tokenizer, build)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = _model_class(config).from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    save_pretrained(model, tokenizer, out_dir)
    if build.arch == "qwen2_5_vl":
        _image_processor(build).save_pretrained(out_dir)
    return Path(out_dir)


def _image_processor(build) -> object:
    """The image processor of a built VLM: patches of ``vision_patch_size``, images scaled to at most
    ``image_max_pixels`` (and at least one merged token's worth)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = 2 * build.vision_patch_size
    return Qwen2VLImageProcessorPil(patch_size=build.vision_patch_size, merge_size=2, temporal_patch_size=2,
                                    min_pixels=side * side, max_pixels=build.image_max_pixels)


def load_image_processor(path: str | Path) -> object | None:
    """The image processor saved beside a vision-language model (None for a text-only one)."""
    if not (Path(path) / "preprocessor_config.json").is_file():
        return None
    from transformers import AutoImageProcessor

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # without torchvision, the PIL processor is used, with a warning
    try:
        return AutoImageProcessor.from_pretrained(path)
    finally:
        hf_logging.set_verbosity(verbosity)


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")  # a vision-language model's image processor


def save_pretrained(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path,
                    metadata: dict | None = None, like: str | Path | None = None) -> None:
    """Save in HF format (safetensors) atomically: written beside, then renamed into place.

    ``metadata`` (the run's step and plugin stack) goes to ``miles.json`` in the same directory; the image
    processor's files of the model directory ``like`` (a vision-language model's) are copied beside.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if metadata is not None:
            (tmp / "miles.json").write_text(json.dumps(metadata, indent=1))
        for name in PROCESSOR_FILES if like is not None else ():
            if (Path(like) / name).is_file():
                shutil.copyfile(Path(like) / name, tmp / name)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_state_dict(weights: dict[str, torch.Tensor], like: str | Path, out_dir: str | Path,
                    tokenizer: PreTrainedTokenizerBase | None = None, metadata: dict | None = None) -> None:
    """Save full ``weights`` (e.g. gathered from shards) as an HF model of the same kind as the model
    directory ``like``, without loading that model's weights."""
    config = AutoConfig.from_pretrained(_check_dir(like))
    with torch.device("meta"):
        model = _model_class(config).from_config(config, dtype=torch.float32)
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    if any(p.is_meta for p in model.parameters()):
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        raise ValueError(f"weights do not cover the model: missing {missing[:8]}")
    if (Path(like) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(like)
    save_pretrained(model, tokenizer, out_dir, metadata, like=like)


def _check_dir(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path {str(path)!r} is not an HF model directory (no config.json there)")
    return path


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The model in ``path`` in ``dtype``. A checkpoint in a low-precision stored form (a published block-FP8 one, or
    one Miles wrote: :mod:`miles.precision.checkpoint`) is dequantized into float weights."""
    config = AutoConfig.from_pretrained(_check_dir(path))
    if getattr(config, "quantization_config", None):
        from miles.precision.checkpoint import read_float_weights
        from miles.precision.experts import fuse_per_expert

        del config.quantization_config
        model = _model_class(config).from_config(config, dtype=torch.float32)  # buffers made; weights replaced below
        from miles.models.mtp import is_head_tensor

        stored = json.loads((Path(path) / "config.json").read_text())
        try:  # an MTP head shipped beside the model is the speculative draft's (miles.models.mtp)
            weights = {k: v for k, v in read_float_weights(path).items() if not is_head_tensor(k, stored)}
            weights = fuse_per_expert(weights, model.state_dict())
        except ValueError as exc:
            raise ConfigError(f"model.path {str(path)!r}: {exc}") from exc
        problems = model.load_state_dict(weights, strict=False)
        model.tie_weights()
        if missing := problems.missing_keys:
            raise ConfigError(f"model.path {str(path)!r}: the checkpoint misses {', '.join(missing[:8])}")
        if problems.unexpected_keys:
            raise ConfigError(f"model.path {str(path)!r}: the checkpoint holds tensors the model has no place for: "
                              f"{', '.join(problems.unexpected_keys[:8])}")
        if (Path(path) / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(path)
        return model.to(dtype).eval()
    return _model_class(config).from_pretrained(path, dtype=dtype)


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights in ``path`` as an engine takes them: a checkpoint in a stored form as stored, a float one as its
    model's state dict."""
    from miles.precision.checkpoint import read_stored_form

    config = json.loads((_check_dir(path) / "config.json").read_text())
    if config.get("quantization_config"):
        return read_stored_form(path)
    return load_model(path).state_dict()


def load_critic(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A value model: the checkpoint's transformer with a new scalar head without bias (one value per
    position), initialised to zero so every value starts at 0 whatever the RNG state."""
    from transformers import AutoModelForTokenClassification

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the new head is expected to be missing from the checkpoint
    try:
        critic = AutoModelForTokenClassification.from_pretrained(_check_dir(path), num_labels=1, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    with torch.no_grad():
        for module in critic.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0  # the head's dropout (0.1 by default): values must not depend on the RNG
            if isinstance(module, torch.nn.Linear) and module.out_features == 1:
                module.weight.zero_()
                module.bias = None  # a one-element parameter cannot be split over data-parallel ranks
    return critic


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(_check_dir(path))


def exact_logprobs(model: PreTrainedModel, input_ids: Sequence[int] | torch.Tensor, *, length: int, pad_token_id: int,
                   with_entropy: bool = False, temperature: torch.Tensor | None = None,
                   top_p: torch.Tensor | None = None, top_k: torch.Tensor | None = None):
    """``[n - 1]`` log p(input_ids[t + 1] | input_ids[:t + 1]) of one sequence of ``n`` tokens, computed the same way
    whatever else is being computed: alone (batch of one), right-padded to ``length`` positions (the context length)
    with causal attention only. Every call has the same shapes and runs the same kernels, and a position's result
    depends only on the tokens at and before it (later positions get exactly zero attention), so the rollout engine
    and the trainer get bit-identical log-probs for the same tokens and weights (``rollout.true_on_policy``).
    With ``with_entropy``, also the entropy of each predicted distribution. ``temperature``, ``top_p``, ``top_k``
    (``[n - 1]`` each, None: the model's own distribution): the distribution each position's log-prob is taken under
    (:func:`miles.models.sampling.distribution_logits`). Differentiable when grad is enabled."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    n = int(ids.numel())
    if not 2 <= n <= length:
        raise ValueError(f"exact_logprobs: a sequence of {n} tokens; expected 2 to {length} (the context length)")
    device = next(model.parameters()).device
    padded = torch.full((1, length), pad_token_id, dtype=torch.long, device=device)
    padded[0, :n] = ids.to(device)
    targets = ids[1:].to(device)
    logits = model(input_ids=padded, use_cache=False).logits[0, : n - 1].float()
    logits = distribution_logits(logits, temperature, top_p, top_k, keep=targets)
    log_p = logits.log_softmax(dim=-1)
    logprobs = log_p.gather(1, targets.unsqueeze(1)).squeeze(1)
    if not with_entropy:
        return logprobs
    terms = log_p.exp() * log_p  # 0 * -inf where top-p/top-k left a token out: nan, taken as 0
    return logprobs, -torch.where(torch.isfinite(log_p), terms, torch.zeros_like(terms)).sum(dim=-1)


def context_length(model_path: str) -> int:
    """The model's context in tokens, read from its config.json."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or config.get("n_positions") or 2**31)
