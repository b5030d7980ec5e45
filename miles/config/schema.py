"""Structured defaults for every config section, each key with its meaning and the values it accepts.

Fixed sections are dataclasses (unknown keys and wrong types are errors); every field is declared with
:func:`miles.config.keys.key`, whose metadata the range checks of :mod:`miles.config.validate` and the
reference table of docs/config.md (:mod:`miles.config.reference`) are made from. Component nodes
(``reward``, ``advantage``, ``loss``, ``backend``, ``rollout.fn`` ...) are open mappings with a
``name`` plus the arguments of the component it names; those are checked against the component's
signature by :mod:`miles.config.validate`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from miles.config.keys import Key, key, keys, like
from miles.models.sampling import LOGPROBS_OF

__all__ = ["MilesConfig", "AsyncConfig", "structured_defaults", "schema_keys", "component_node", "split_node",
           "COMPONENT_NODES", "COMPONENT_LISTS", "SCHEDULES"]

SCHEDULES = ("sync", "one_step_off", "async")  # run.schedule (miles/loop/schedules.py)


def _component(name: str, doc: str) -> Any:
    return key(doc=doc, factory=lambda: {"name": name})


@dataclass
class TokenizerConfig:
    kind: str = key("char", choices=("char", "qwen", "deepseek"),
                    doc="`char`: one token per character of the alphabet; `qwen`, `deepseek`: a real BPE vocabulary")
    max_ranks: int = key(0, ge=256, also=(0,), expected="0 (the whole vocabulary) or at least 256",
                         doc="qwen/deepseek: keep the vocabulary's first this many tokens (0: all)")
    alphabet: str = key("0123456789+-*= ", doc="kind char: the characters")
    special_tokens: list[str] = key(factory=list, doc="Strings that are one token each, dropped from decoded text")
    added_tokens: list[str] = key(factory=list, doc="Strings that are one token each, kept in decoded text")
    chat_template: Optional[str] = key(None, doc="A Jinja chat template file, or a shipped one: `chatml_tools`")


@dataclass
class ModelBuildConfig:
    arch: str = key("qwen3", doc="`qwen3`, `qwen3_moe` (every MLP a set of routed experts), or `qwen2_5_vl` "
                                 "(a vision tower and multimodal RoPE; the tokenizer needs `<|vision_start|>`, "
                                 "`<|image_pad|>`, `<|vision_end|>`)")
    hidden_size: int = key(64, doc="Hidden size")
    num_layers: int = key(2, doc="Decoder layers")
    num_heads: int = key(4, doc="Attention heads")
    num_kv_heads: int = key(2, doc="Key/value heads (grouped-query attention)")
    head_dim: int = key(16, doc="Size of one head")
    intermediate_size: int = key(256, doc="MLP width")
    max_position_embeddings: int = key(128, doc="Context length: prompt plus response tokens")
    num_experts: int = key(8, doc="qwen3_moe: experts per MoE layer")
    num_experts_per_tok: int = key(2, doc="qwen3_moe: experts the router picks for each token (top-k)")
    moe_intermediate_size: int = key(128, doc="qwen3_moe: each expert's MLP width")
    norm_topk_prob: bool = key(True, doc="qwen3_moe: renormalise the chosen experts' gate weights to sum to 1")
    vision_depth: int = key(2, ge=1, doc="qwen2_5_vl: blocks of the vision tower")
    vision_hidden_size: int = key(32, ge=8, doc="qwen2_5_vl: the vision tower's width")
    vision_num_heads: int = key(2, ge=1, doc="qwen2_5_vl: the vision tower's attention heads")
    vision_patch_size: int = key(14, ge=2, doc="qwen2_5_vl: pixels per side of a patch; 2x2 patches make a token")
    image_max_pixels: int = key(112 * 112, ge=64, doc="qwen2_5_vl: larger images are scaled down to this many "
                                                      "pixels by the image processor (112x112: 16 tokens)")


@dataclass
class ModelConfig:
    path: Optional[str] = key(None, doc="An HF-format model directory or a Hugging Face Hub id (`Qwen/Qwen3-0.6B`, "
                                        "fetched once into the Hub's cache); when unset, a model is built from `build`")
    build: ModelBuildConfig = key(factory=ModelBuildConfig, doc="The architecture of a built model (random init)")
    tokenizer: TokenizerConfig = key(factory=TokenizerConfig, doc="The tokenizer of a built model")
    chat_format: str = key("auto", doc="How the model family talks in multi-turn rollouts: a registered chat format, "
                                       "or `auto` (detected from the tokenizer)")
    chat_template: Optional[str] = key(None, doc="A Jinja file or a shipped template that renders every turn, for "
                                                 "`model.path` checkpoints too")
    chat_template_kwargs: Dict[str, Any] = key(factory=dict, doc="Variables for every rendering: "
                                                                 "`{enable_thinking: false}`")


@dataclass
class DataConfig:
    train_path: Optional[str] = key(None, doc="Training prompts: a JSONL or Parquet file, or `hf:ORG/NAME`, a Hugging "
                                              "Face Hub dataset (its split `train_split`, kept in `<dir>/data/`)")
    eval_path: Optional[str] = key(None, doc="Held-out prompts for evaluation (a file, or `hf:ORG/NAME`: its split "
                                             "`eval_split`)")
    hub_subset: Optional[str] = key(None, doc="The subset (configuration) of `hf:` datasets, e.g. `main`")
    train_split: str = key("train", doc="The split of an `hf:` `train_path`")
    eval_split: str = key("test", doc="The split of an `hf:` `eval_path`")
    generator: Any = key(None, doc="A data generator node: its train and eval splits are written under the run dir")
    prompt_key: str = key("prompt", doc="The column holding the prompt: text, or a list of chat messages")
    label_key: str = key("label", doc="The column holding the label")
    chat_template: str = key("auto", choices=("auto", "true", "false", True, False),
                             doc="`auto`: the tokenizer's chat template when it has one; `true` requires one")
    shuffle: bool = key(True, doc="Serve prompts in a seeded shuffled order, reshuffled each epoch")
    overlong_prompts: str = key("error", choices=("error", "drop"),
                                doc="Prompts that leave no room for `max_new_tokens`: refuse the run, or drop them")
    max_unk_prompt_frac: float = key(0.0, ge=0, le=1, expected="a fraction between 0 and 1",
                                     doc="The largest share of prompts (per file) that may hold text the tokenizer "
                                         "cannot encode (its unknown token, `<unk>`) before the run is refused; "
                                         "0: none may")


@dataclass
class SFTConfig:
    steps: int = key(0, ge=0, doc="Supervised warm-up steps on prompt/label pairs before RL; 0 skips it")
    batch_size: int = key(64, ge=1, doc="Pairs per step")
    lr: float = key(3e-3, gt=0, doc="Learning rate of the warm-up (instead of `backend.lr`)")
    loss: Any = _component("sft", doc="The loss node (`sft`: token-mean negative log-likelihood)")
    messages_key: Optional[str] = key(None, doc="A data column with the conversation to train on (multi-turn traces)")


@dataclass
class SamplingConfig:
    max_new_tokens: int = key(16, ge=1, doc="Response length cap; a response that hits it is truncated")
    temperature: float = key(1.0, ge=0, note="0 is greedy", doc="Sampling temperature; 0 is greedy")
    top_p: float = key(1.0, gt=0, le=1, doc="Nucleus sampling; 1.0 is off")
    top_k: int = key(-1, ge=1, also=(-1,), expected="-1 (off) or a whole number >= 1", doc="Top-k sampling; -1 is off")


@dataclass
class TitoConfig:
    """``rollout.tito``: token in, token out across turns."""

    on_mismatch: str = key("auto", choices=("auto", "fail", "split", "retokenize"),
                           doc="A template whose rendering differs from the tokens a trajectory holds: fail the "
                               "sample, split it there, or re-render and mask the changed tokens; `auto`: split, "
                               "retokenize with an estimator of per-token values")


@dataclass
class RolloutConfig:
    fn: Any = _component("single_turn", doc="Rollout function node: `single_turn`, `multi_turn`, `agent`")
    env: Any = key(None, doc="The environment node of multi-turn rollouts (`multi_turn`, `agent`)")
    sandbox: Any = key(None, doc="The sandbox node where tools run code (`{name: local}`), one per trajectory")
    tool_parser: Any = key(None, doc="How tool calls are found in generated text; null: the chat format's parser")
    engine: Any = _component("local", doc="Rollout engine node; `num_engines` 0 runs it in process, N >= 1 serves N "
                                          "over HTTP as Ray actors")
    weight_sync: Any = _component("auto", doc="Weight transport node: how new weights reach the engines")
    precision: Any = _component("bf16", doc="Precision scheme node of the engines' weights: `bf16` (none), "
                                            "`fp8_block`, `fp8_channel`, `int4_w4a16`, `mxfp8`, `nvfp4`; the trainer "
                                            "pushes the quantized form")
    prompts_per_step: int = key(16, ge=1, doc="Prompts per RL step")
    n_samples: int = key(8, ge=1, doc="Samples per prompt (the group size for GRPO)")
    partial_rollout: bool = key(False, doc="Abort what is still generating once the batch is full; continue it "
                                           "next step")
    mask_off_policy: bool = key(False, doc="Leave the tokens an older policy sampled out of the loss")
    return_routed_experts: bool = key(False, doc="MoE models: the engine returns each token's expert ids, kept in "
                                                 "the samples")
    sampling: SamplingConfig = key(factory=SamplingConfig, doc="Sampling parameters sent with every request")
    tito: TitoConfig = key(factory=TitoConfig, doc="Token in, token out across turns")
    logprobs_of: str = key("sampling", choices=LOGPROBS_OF,
                           doc="The distribution a sampled token's log-prob is taken under, by the engine and the "
                               "trainer alike: `sampling` (at its temperature), `truncated` (temperature, then "
                               "top-p/top-k) or `model` (temperature 1)")
    true_on_policy: bool = key(False, doc="The engine's log-probs of sampled tokens bit-identical to the trainer's "
                                          "(dense models, the local engine)")


@dataclass
class AsyncConfig:
    """``rollout.async``: how the rollout plane runs ahead of training (``run.schedule`` one_step_off or async).
    Its key is a Python keyword, so the node is added to the schema by :func:`structured_defaults`."""

    max_staleness: int = key(1, ge=0, doc="No trained group was started more than this many weight versions "
                                          "before the weights it trains")
    max_concurrent_samples: int = key(0, ge=0, note="0: from max_staleness",
                                      doc="Samples generating at once; 0: (max_staleness + 1) x one step's samples")
    stale: str = key("drop", choices=("drop", "retry"),
                     doc="Groups older than `max_staleness` when taken: `drop` them or `retry` (generate again)")
    update: Optional[str] = key(None, choices=("pause", "abort", "in_place"),
                                doc="New weights while requests run; null: `pause` (`abort` with partial_rollout)")


@dataclass
class PluginsConfig:
    allow: Optional[list[str]] = key(None, doc="Entry-point plugins to load (builtins always load); null loads all")


@dataclass
class RunConfig:
    steps: int = key(100, ge=0, doc="RL steps (0 for SFT only)")
    schedule: str = key("sync", choices=SCHEDULES, doc="How rollout and training share time: `sync`, `one_step_off` "
                                                       "(step k+1 generates while step k trains) or `async`")
    dir: str = key("runs/default", doc="Output folder")
    seed: int = key(0, doc="Seeds data order, model init, sampling and training")
    eval_every: Optional[int] = key(None, ge=0, doc="Also evaluate every k steps (0: only before and after RL; "
                                                    "null: at each fifth of the run, every `steps // 5`)")
    eval_size: int = key(200, ge=0, doc="Held-out prompts per evaluation; 0 disables evaluation")
    eval_pass_reward: float = key(1.0, doc="A held-out prompt counts as solved at this reward or above")
    max_failed_frac: float = key(0.5, ge=0, le=1, expected="a fraction between 0 and 1",
                                 doc="Stop the run when more of a step's samples fail")
    progress: bool = key(True, doc="Progress on stderr: a bar on a terminal, plain lines in a log")
    torch_threads: int = key(0, doc="torch intra-op threads; 0 keeps torch's default")
    save_every: int = key(0, doc="Write a checkpoint every k RL steps (0: none)")
    keep_checkpoints: int = key(2, doc="Newest checkpoints kept (0 keeps all)")
    export_precision: Any = _component("bf16", doc="Precision scheme node of an extra copy of the final model "
                                                   "(`final_model_<scheme>/`) and of each checkpoint's "
                                                   "(`model_<scheme>/`), in its stored form (`bf16`: none)")
    resume: bool = key(False, doc="Continue from the newest complete checkpoint under `<dir>/checkpoints`, if any")
    overwrite: bool = key(False, doc="Replace what an earlier run left in `dir` (without it, a non-empty `dir` is "
                                     "refused)")
    save_rollouts: bool = key(False, doc="Write every step's training samples to `<dir>/rollouts/` (token-exact) "
                                         "for `miles replay`")
    trajectories: int = key(2, ge=0, doc="Groups of each step written to `<dir>/trajectories/` token by token "
                                         "(log-probs, loss mask, advantages) for `miles view` and `miles report`; "
                                         "0: none. Costs one more forward pass over their samples")
    rollout_only: bool = key(False, doc="Generate, score and select every step; no training, no weight push")
    loggers: Any = key(factory=lambda: [{"name": "jsonl"}], doc="Metric logger nodes")
    plugins: PluginsConfig = key(factory=PluginsConfig, doc="Which installed plugins to load")


@dataclass
class RegularizationConfig:
    kl_coef: float = key(0.0, ge=0, doc="Weight of the KL; > 0 loads the RL starting checkpoint as a frozen "
                                        "reference model")
    kl_estimator: str = key("k3", choices=("k1", "k2", "k3"), doc="Schulman's KL estimator")
    kl_in: str = key("loss", choices=("loss", "reward"),
                     doc="`loss`: a term of the loss; `reward`: a per-sequence penalty before advantages")
    entropy_coef: float = key(0.0, ge=0, doc="Entropy bonus (subtracted from the loss)")


@dataclass
class RouterConfig:
    health_interval_s: float = key(1.0, doc="Seconds between health checks")
    max_failures: int = key(3, ge=1, doc="Failed health checks before an engine is quarantined")
    max_retries: int = key(3, ge=0, doc="A failed request is retried on another engine this many times")
    request_timeout_s: float = key(600.0, doc="Deadline for one request, retries included")
    batch_requests: bool = key(True, doc="One batched `/generate` per engine for the requests of one event-loop turn")


@dataclass
class ClusterConfig:
    address: Optional[str] = key(None, doc="An existing Ray cluster (`auto`, `ray://host:10001`); null starts a "
                                           "local one")
    num_cpus: Optional[int] = key(None, doc="CPUs of the local Ray instance; null: all of this machine's")
    object_store_mb: int = key(256, ge=75, expected="at least 75 (Ray's minimum)",
                               doc="Cap on the local object store, in MB")
    cpus_per_engine: float = key(1.0, gt=0, doc="CPUs reserved for each engine")
    train_cpus: float = key(1.0, gt=0, doc="CPUs reserved for the training worker actor")
    # Engines / training workers run only on the nodes that offer these (`ray start --resources`); a local
    # instance offers what the run needs.
    engine_resources: Dict[str, float] = key(factory=dict, doc="Custom Ray resources each engine reserves: "
                                                               "`{engine_node: 1}`")
    train_resources: Dict[str, float] = key(factory=dict, doc="Custom Ray resources each training worker reserves")
    # 10 minutes: a large model takes minutes to load (SGLang's router allows 30), and a crowded machine slows the start
    engine_startup_timeout_s: float = key(600.0, gt=0, expected="a positive number of seconds",
                                          doc="Engines not placed, started and healthy by then fail the run")
    router: RouterConfig = key(factory=RouterConfig, doc="The router in front of the engines")
    local_mode: bool = key(False, doc="Every plane in this process, no time limits: debugger breakpoints work in "
                                      "rollouts, rewards and losses")


@dataclass
class DistillConfig:
    """On-policy distillation (docs/distillation.md): a teacher scores the student's samples token by token."""

    teacher: Optional[str] = key(None, doc="The teacher: an HF directory, served by an in-process engine of its own")
    teacher_url: Optional[str] = key(None, doc="Or an SGLang-compatible server already serving it; not with `teacher`")
    kl_coef: float = key(1.0, ge=0, doc="Weight of the per-token reverse KL in the advantages")
    reward_coef: float = key(0.0, ge=0, doc="Weight of the reward's advantages; 0: distillation alone")


@dataclass
class EvalSamplingConfig:
    """What an evaluation set changes of ``rollout.sampling`` (each key accepting what it does there); null keeps
    the training value."""

    max_new_tokens: Optional[int] = key(None, doc="Response length cap", **like(SamplingConfig, "max_new_tokens"))
    temperature: Optional[float] = key(None, doc="Sampling temperature", **like(SamplingConfig, "temperature"))
    top_p: Optional[float] = key(None, doc="Nucleus sampling", **like(SamplingConfig, "top_p"))
    top_k: Optional[int] = key(None, doc="Top-k sampling", **like(SamplingConfig, "top_k"))


@dataclass
class EvalDatasetConfig:
    name: str = key("heldout", doc="Names the metrics `eval/<name>/...`: letters, digits, `_`, `.`, `-`; unique")
    path: Optional[str] = key(None, doc="JSONL or Parquet; null: `data.eval_path` (or the data generator's eval split)")
    max_prompts: int = key(0, ge=0, note="0: all", doc="The first this many rows; 0: all")
    n: int = key(1, ge=1, note="samples per prompt", doc="Samples per prompt")
    k: list[int] = key(factory=lambda: [1], doc="`eval/<name>/pass@k` for each k (each from 1 to n)")
    pass_reward: float = key(1.0, doc="A sample counts as correct at this reward or above")
    sampling: EvalSamplingConfig = key(factory=EvalSamplingConfig, doc="What the dataset changes of `rollout.sampling`")


@dataclass
class EvalConfig:
    every: int = key(0, ge=0, doc="Evaluate the datasets every k RL steps too (0: only before the first and after "
                                  "the last)")
    datasets: list[EvalDatasetConfig] = key(factory=list, doc="Held-out datasets, each a section of the keys below")


@dataclass
class MilesConfig:
    model: ModelConfig = key(factory=ModelConfig, doc="The policy: an HF checkpoint, or a model built from `build`")
    data: DataConfig = key(factory=DataConfig, doc="Training and held-out prompts")
    sft: SFTConfig = key(factory=SFTConfig, doc="Supervised warm-up on prompt/label pairs before RL")
    rollout: RolloutConfig = key(factory=RolloutConfig, doc="Generation: rollout function, engines, sampling")
    reward: Any = _component("exact_match", doc="The reward node")
    advantage: Any = _component("grpo", doc="The advantage estimator node")
    loss: Any = _component("ppo_clip", doc="The policy loss node")
    selection: Any = key(factory=list, doc="Data selector nodes, applied in order")
    backend: Any = _component("torch", doc="The training backend node, with its training options")
    regularization: RegularizationConfig = key(factory=RegularizationConfig,
                                               doc="KL to a frozen reference policy and an entropy bonus")
    distill: DistillConfig = key(factory=DistillConfig, doc="On-policy distillation from a teacher")
    run: RunConfig = key(factory=RunConfig, doc="Steps, schedule, output folder, evaluation, checkpoints, loggers")
    eval: EvalConfig = key(factory=EvalConfig, doc="Held-out datasets evaluated during and after the run")
    cluster: ClusterConfig = key(factory=ClusterConfig, doc="Ray: the cluster, and what engines and workers reserve")


# Sections whose key is a Python keyword, added to the schema by :func:`structured_defaults`.
KEYWORD_SECTIONS: dict[str, Any] = {
    "rollout.async": key(factory=AsyncConfig, doc="How the rollout plane runs ahead of training (`run.schedule` "
                                                  "one_step_off or async)"),
}


def structured_defaults() -> DictConfig:
    """The schema as a structured OmegaConf config, ``rollout.async`` included."""
    schema = OmegaConf.structured(MilesConfig)
    for path, section in KEYWORD_SECTIONS.items():
        parent, _, name = path.rpartition(".")
        node = OmegaConf.select(schema, parent)
        with open_dict(node):
            node[name] = OmegaConf.structured(section.default_factory)
    return schema


def schema_keys() -> Iterator[Key]:
    """Every key of the config, sections included, in the schema's order."""
    return keys(MilesConfig, extra=KEYWORD_SECTIONS)


# Where component nodes live, and which kind each names. A null node is allowed where noted.
COMPONENT_NODES: dict[str, str] = {
    "reward": "reward",
    "advantage": "advantage",
    "loss": "loss",
    "backend": "backend",
    "sft.loss": "loss",
    "rollout.fn": "rollout_fn",
    "rollout.env": "env",
    "rollout.sandbox": "sandbox",
    "rollout.tool_parser": "tool_parser",
    "rollout.engine": "rollout_engine",
    "rollout.weight_sync": "weight_transport",
    "rollout.precision": "precision",
    "run.export_precision": "precision",
    "data.generator": "data_generator",
}
OPTIONAL_NODES = {"data.generator", "rollout.env", "rollout.sandbox", "rollout.tool_parser"}
# Keys of a component node that configure how it is run rather than the component itself, with defaults.
ORCHESTRATION_KEYS: dict[str, dict[str, Any]] = {
    # num_engines 0: in process; N >= 1: N engines over HTTP as Ray actors. release_memory_during_train: the
    # engines free their weights and KV cache while the trainer trains (sync schedule; a colocated trainer).
    # separate_process (num_engines 0): serve the engine from a child process (auto: under a streaming schedule,
    # on 2 cores or more, when the trainer keeps this process: backend.separate_process; miles/engine/process.py)
    "rollout.engine": {"num_engines": 0, "release_memory_during_train": False, "separate_process": "auto"},
    # separate_process: train in a child process beside the rollout plane (auto: under a streaming schedule whose
    # engine generates in this process, on 2 cores or more; miles/train/process_backend.py)
    "backend": {"separate_process": "auto"},
    "rollout.fn": {"timeout_s": 0.0},  # seconds per sample, waiting for the engine included; 0: no limit
    # timeout_s: seconds per call (per batch for a batched reward); 0: no limit. max_abs: a sample whose reward is
    # larger in magnitude fails (larger rewards overflow the advantages and the loss); at most MAX_REWARD_BOUND
    "reward": {"timeout_s": 60.0, "max_abs": 1e6},
    # sandboxes kept started for the next trajectories (sandboxes/pool.py); 0: none; auto: as many as run at once
    "rollout.sandbox": {"pool": 0},
}
# The largest reward.max_abs: the square of a reward (a group's variance) still fits float32 (3.4e38) with room.
MAX_REWARD_BOUND = 1e18
COMPONENT_LISTS: dict[str, str] = {"selection": "data_selector", "run.loggers": "logger"}


def component_node(node: Any) -> dict[str, Any]:
    """A component node as a plain dict (a bare string is shorthand for ``{name: string}``)."""
    if isinstance(node, str):
        return {"name": node}
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    if isinstance(node, Mapping):
        return dict(node)
    raise TypeError(type(node).__name__)


def split_node(node: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(component arguments, orchestration keys with their defaults) of a node."""
    plain = component_node(node)
    extra = {k: plain.pop(k, default) for k, default in ORCHESTRATION_KEYS.get(where, {}).items()}
    return plain, extra
