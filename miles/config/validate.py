"""Checking a loaded config before anything runs: every component node against the signature of
what it names, and every value against what its key accepts (declared next to the field in
:mod:`miles.config.schema`). All problems are reported at once."""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from miles.config.algorithms import conflicts
from miles.config.keys import keys
from miles.config.schema import (COMPONENT_LISTS, COMPONENT_NODES, MAX_REWARD_BOUND, OPTIONAL_NODES, EvalDatasetConfig,
                                 component_node, schema_keys, split_node)
from miles.errors import ConfigError
from miles.hookspecs import ChecksArgs, LogprobsOfEngine, NeedsValues, is_server_launcher, uses_ray
from miles.registry import KINDS, Registry, nested_nodes

__all__ = ["validate_config", "component_node", "split_node"]

# Ray's own resources, which have keys of their own (cpus_per_engine, train_cpus) or are not for placement.
_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")

def _range_problems(config: DictConfig) -> list[str]:
    """Every value outside what its key accepts, in the schema's order (a list of sections is checked by its own)."""
    found = (entry.problem(OmegaConf.select(config, entry.path)) for entry in schema_keys()
             if entry.accepts is not None and "[i]" not in entry.path)
    return [problem for problem in found if problem]


def _resource_problems(cluster: Any) -> list[str]:
    problems = []
    for key in ("engine_resources", "train_resources"):
        for name, amount in (cluster[key] or {}).items():
            if name in _BUILTIN_RESOURCES or name.startswith("node:"):
                problems.append(f"cluster.{key}.{name}: expected a custom Ray resource (a name given to "
                                f"`ray start --resources`); CPUs are cluster.cpus_per_engine / cluster.train_cpus")
            elif not amount > 0:
                problems.append(f"cluster.{key}.{name}: expected a positive amount, got {amount!r}")
    return problems


def _distill_problems(distill: Any) -> list[str]:
    """Teacher and server are exclusive, and a distillation must learn something (coefficients: by their range)."""
    problems = []
    if distill.teacher and distill.teacher_url:
        problems.append("distill: set distill.teacher (an HF directory served in process) or distill.teacher_url "
                        "(a server already serving the teacher), not both")
    if (distill.teacher or distill.teacher_url) and not problems and not (distill.kl_coef or distill.reward_coef):
        problems.append("distill: kl_coef and reward_coef are both 0, so nothing would be learned; set kl_coef > 0")
    return problems


def _eval_problems(eval_cfg: Any) -> list[str]:
    """``eval.datasets``: each name unique and usable in a metric name, every k in 1..n, each key in its range."""
    problems: list[str] = []
    seen: set[str] = set()
    accepts = {entry.path: entry for entry in keys(EvalDatasetConfig) if entry.accepts is not None}
    for i, ds in enumerate(eval_cfg.datasets):
        where = f"eval.datasets[{i}]"
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", ds.name or ""):
            problems.append(f"{where}.name: expected letters, digits, '_', '.' or '-' (it names the metrics "
                            f"eval/<name>/...), got {ds.name!r}")
        elif ds.name in seen:
            problems.append(f"{where}.name: {ds.name!r} names two datasets; each needs a name of its own")
        seen.add(ds.name)
        if n_problem := accepts["n"].problem(ds.n, f"{where}.n"):
            problems.append(n_problem)
        elif not ds.k or any(not 1 <= k <= ds.n for k in ds.k):
            problems.append(f"{where}.k: expected a list of whole numbers from 1 to n={ds.n} (pass@k needs k <= n "
                            f"samples per prompt), got {list(ds.k)!r}")
        for path, entry in accepts.items():
            if path != "n" and (problem := entry.problem(OmegaConf.select(ds, path), f"{where}.{path}")):
                problems.append(problem)
    return problems


def _argument_problems(registry: Registry, kind: str, args: dict[str, Any], where: str) -> list[str]:
    """Arguments that only work together, as the component judges them (raising ValueError): a data
    selector's constructor, or the ``check_args(args)`` a component carries, given the node's arguments
    over the defaults of its signature. Nested component nodes (``miles_components``) are judged too."""
    obj = registry.get(kind, args["name"]).obj
    given = {k: v for k, v in args.items() if k != "name"}
    try:
        if kind == "data_selector" and inspect.isclass(obj):
            obj(**given)
        elif isinstance(obj, ChecksArgs):
            params = list(inspect.signature(obj).parameters.values())[KINDS[kind].call_params or 0:] \
                if KINDS[kind].per_use else inspect.signature(obj).parameters.values()
            obj.check_args({**{p.name: p.default for p in params if p.default is not p.empty}, **given})
    except (TypeError, ValueError) as exc:
        return [f"{where}: {kind} {args['name']!r} rejected its arguments: {exc}"]
    problems = []
    for arg, nested_kind, nested in nested_nodes(obj, given):
        problems += _argument_problems(registry, nested_kind, component_node(nested), f"{where}.{arg}")
    return problems


def _check_node(registry: Registry, kind: str, node: Any, where: str) -> list[str]:
    try:
        plain, extra = split_node(node, where)
    except TypeError:
        return [f"{where}: expected a mapping with 'name' (the {kind} to use) and its arguments, got {node!r}"]
    problems = registry.check(kind, plain, where) or _argument_problems(registry, kind, plain, where)
    timeout = extra.get("timeout_s", 0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
        problems.append(f"{where}.timeout_s: expected a number of seconds > 0, or 0 for no limit, got {timeout!r}")
    bound = extra.get("max_abs", MAX_REWARD_BOUND)
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound <= MAX_REWARD_BOUND:
        problems.append(f"{where}.max_abs: expected the largest reward magnitude a sample may have, a number > 0 and "
                        f"at most {MAX_REWARD_BOUND:g} (the square of a larger one overflows float32 advantages), "
                        f"got {bound!r}")
    pool = extra.get("pool", 0)
    if pool != "auto" and (isinstance(pool, bool) or not isinstance(pool, int) or pool < 0):
        problems.append(f"{where}.pool: expected a whole number >= 0 (0: no pool) or auto (as many as the "
                        f"trajectories that run at once), got {pool!r}")
    engines = extra.get("num_engines", 0)
    if isinstance(engines, bool) or not isinstance(engines, int) or engines < 0:
        problems.append(f"{where}.num_engines: expected a whole number >= 0 (0: in process), got {engines!r}")
    elif where == "rollout.engine" and not problems:
        problems += _engine_problems(registry, plain, engines, extra)
    if where == "backend" and not problems:
        separate = extra["separate_process"]
        if not (separate == "auto" or isinstance(separate, bool)):
            problems.append(f"backend.separate_process: expected auto, true or false, got {separate!r}")
        elif separate is True and uses_ray(registry.get("backend", plain["name"]).obj):
            problems.append(f"backend.separate_process: true trains in a child process of this one, but backend "
                            f"{plain['name']!r} trains in Ray workers of its own already; use auto or false")
    return problems


def _engine_problems(registry: Registry, plain: dict[str, Any], engines: int, extra: dict[str, Any]) -> list[str]:
    """A server launcher (e.g. ``sglang``) runs only as N >= 1 engines over HTTP; ``local`` either way."""

    problems = []
    name = plain.get("name")
    launcher = is_server_launcher(registry.get("rollout_engine", name).obj)
    if engines == 0 and launcher:
        problems.append(f"rollout.engine.num_engines: engine {name!r} runs as a server of its own, so it needs "
                        f"rollout.engine.num_engines >= 1 (engines over HTTP as Ray actors), got 0")
    elif engines > 0 and not launcher and name != "local":
        problems.append(f"rollout.engine.num_engines: engines over HTTP are 'local' or a server launcher "
                        f"(e.g. 'sglang', 'miles_server'), got {name!r}")
    separate = extra.get("separate_process", "auto")
    if not (separate == "auto" or isinstance(separate, bool)):
        problems.append(f"rollout.engine.separate_process: expected auto, true or false, got {separate!r}")
    elif separate is True and (engines > 0 or name != "local"):
        problems.append(f"rollout.engine.separate_process: true serves the builtin engine 'local' from a process "
                        f"of its own (with num_engines 0); got engine {name!r} with num_engines {engines}")
    release = extra.get("release_memory_during_train", False)
    if not isinstance(release, bool):
        problems.append(f"rollout.engine.release_memory_during_train: expected true or false, got {release!r}")
    elif release and engines == 0:
        problems.append("rollout.engine.release_memory_during_train: engines release their memory over HTTP; "
                        "set rollout.engine.num_engines >= 1")
    return problems


def _agentic_problems(config: DictConfig, registry: Registry) -> list[str]:
    """An env's ``tools`` must name registered tools; a tool that runs code needs ``rollout.sandbox``;
    ``multi_turn`` needs an env."""
    problems = []
    fn, env = component_node(config.rollout.fn), config.rollout.env
    if fn["name"] == "multi_turn" and env is None:
        problems.append("rollout.env: rollout function 'multi_turn' needs an environment, e.g. "
                        "{name: tool_env, tools: [execute_python_code]}")
    tools = component_node(env).get("tools") if env is not None else None
    if isinstance(tools, (list, ListConfig)):
        for i, name in enumerate(tools):
            try:
                tool = resolve_tool(registry, name, f"rollout.env.tools[{i}]")
            except ConfigError as exc:
                problems.append(str(exc))
                continue
            if tool.needs_sandbox and config.rollout.sandbox is None:
                problems.append(f"rollout.sandbox: tool {name!r} runs code in a sandbox; set one, e.g. {{name: local}}")
    if config.rollout.tito.on_mismatch == "split" and needs_values(config, registry):
        advantage = component_node(config.advantage)["name"]
        problems.append(f"rollout.tito.on_mismatch: split trains a trajectory's earlier parts with its mean "
                        f"advantage, which advantage {advantage!r} (per-token values) does not have; use "
                        f"retokenize, fail or auto, or a sequence-level estimator (grpo, rloo, reinforce_pp, ...)")
    if config.rollout.true_on_policy:
        problems += _true_on_policy_problems(config, registry)
    problems += _logprobs_of_problems(config, registry)
    choice = config.model.chat_format
    if choice != "auto":
        try:
            registry.get("chat_format", choice, where="model.chat_format")
        except ConfigError as exc:
            problems.append(f"{exc} (or auto: detected from the tokenizer)")
    return problems


def needs_values(config: DictConfig, registry: Registry) -> bool:
    """Whether the configured advantage estimator uses per-token values (a value model's)."""
    try:
        estimator = registry.get("advantage", component_node(config.advantage)["name"]).obj
    except ConfigError:
        return False  # reported with the advantage node
    return isinstance(estimator, NeedsValues) and bool(estimator.needs_values)


def tito_on_mismatch(config: DictConfig, registry: Registry) -> str:
    """``rollout.tito.on_mismatch``, ``auto`` resolved: ``split`` (every generated token trains, in the context it was
    generated in, and the trajectory goes on from the template's rendering), ``retokenize`` when the estimator's
    per-token values cannot follow a split."""
    choice = str(config.rollout.tito.on_mismatch)
    if choice != "auto":
        return choice
    return "retokenize" if needs_values(config, registry) else "split"


def _true_on_policy_problems(config: DictConfig, registry: Registry) -> list[str]:
    """``rollout.true_on_policy`` needs an engine and a backend that compute log-probs the exact way."""
    problems = []
    engine = component_node(config.rollout.engine)["name"]
    if engine != "local":
        problems.append(f"rollout.true_on_policy: needs the local engine (it computes the sampled tokens' log-probs as "
                        f"the trainer does); rollout.engine is {engine!r}")
    backend = component_node(config.backend)["name"]
    try:
        takes = "exact_logprobs" in inspect.signature(registry.get("backend", backend).obj).parameters
    except (ConfigError, TypeError, ValueError):
        takes = True  # reported with the backend node
    if not takes:
        problems.append(f"rollout.true_on_policy: backend {backend!r} has no exact_logprobs option; use torch or fsdp2")
    if str(component_node(config.backend).get("share_prefixes", "auto")).lower() == "true":
        problems.append("rollout.true_on_policy: the trainer computes each sequence alone, as the engine does; "
                        "backend.share_prefixes true cannot go with it (auto does not share under it)")
    if config.model.build.arch != "qwen3" and config.model.path is None:
        problems.append(f"rollout.true_on_policy: dense models only; model.build.arch is {config.model.build.arch!r}")
    return problems


def _logprobs_of_problems(config: DictConfig, registry: Registry) -> list[str]:
    """``rollout.logprobs_of``: the engine must report the sampled tokens' log-probs under that distribution, and the
    trainer must be able to compute it."""
    wanted, problems = str(config.rollout.logprobs_of), []
    node = component_node(config.rollout.engine)
    if "logprobs_of" in node:
        problems.append("rollout.engine.logprobs_of: set by rollout.logprobs_of (the engine and the trainer take the "
                        "same distribution); remove it from the engine node")
    try:
        engine = registry.get("rollout_engine", node["name"]).obj
    except ConfigError:
        return problems  # reported with the engine node
    choices = engine.logprobs_of_choices if isinstance(engine, LogprobsOfEngine) else ("sampling",)
    if wanted not in choices:
        problems.append(f"rollout.logprobs_of: rollout engine {node['name']!r} reports the sampled tokens' log-probs "
                        f"under {' or '.join(choices)}, got {wanted!r}")
    if wanted == "truncated" and component_node(config.backend).get("logprob_chunk_tokens", 0):
        problems.append("rollout.logprobs_of: truncated needs the whole vocabulary's logits of each token (top-p and "
                        "top-k sort them); backend.logprob_chunk_tokens must be 0")
    return problems


def _schedule_problems(config: DictConfig) -> list[str]:
    """``rollout.async`` against the schedule it shapes."""
    if config.run.schedule == "sync":
        return []
    problems, node = [], config.rollout["async"]
    if split_node(config.rollout.engine, "rollout.engine")[1]["release_memory_during_train"]:
        problems.append(f"rollout.engine.release_memory_during_train: the engines generate while the trainer trains "
                        f"with run.schedule {config.run.schedule}; it needs run.schedule sync")
    update = node["update"]  # not node.update: that is the mapping's method
    if config.rollout.partial_rollout and update not in (None, "abort"):
        problems.append(f"rollout.partial_rollout: with run.schedule {config.run.schedule}, samples are aborted and "
                        f"continued by weight updates (rollout.async.update: abort), got update: {update}")
    if node.max_concurrent_samples and node.max_concurrent_samples < config.rollout.n_samples:
        problems.append(f"rollout.async.max_concurrent_samples: expected 0 or at least one group "
                        f"(rollout.n_samples={config.rollout.n_samples}), got {node.max_concurrent_samples}")
    if (config.run.schedule == "one_step_off" and node.max_concurrent_samples
            and node.max_concurrent_samples < config.rollout.prompts_per_step * config.rollout.n_samples):
        problems.append(f"rollout.async.max_concurrent_samples: one_step_off generates a whole step at once "
                        f"({config.rollout.prompts_per_step * config.rollout.n_samples} samples), got "
                        f"{node.max_concurrent_samples}")
    return problems


def _debug_problems(config: DictConfig, registry: Registry) -> list[str]:
    """``run.rollout_only`` trains nothing (so has nothing to checkpoint or resume); ``cluster.local_mode`` runs
    every plane in this process, one step after the other."""
    problems, run_cfg = [], config.run
    if run_cfg.rollout_only and run_cfg.save_every:
        problems.append(f"run.save_every: run.rollout_only trains nothing, so there is nothing to checkpoint; "
                        f"set run.save_every=0 (got {run_cfg.save_every})")
    if run_cfg.rollout_only and run_cfg.resume:
        problems.append("run.resume: run.rollout_only starts from the start model and trains nothing; it continues "
                        "no checkpoint (run.resume=false)")
    if not config.cluster.local_mode:
        return problems
    if config.cluster.address:
        problems.append(f"cluster.address: cluster.local_mode runs every plane in this process and joins no Ray "
                        f"cluster; unset one of them (got address {config.cluster.address!r})")
    if run_cfg.schedule != "sync":
        problems.append(f"run.schedule: cluster.local_mode runs rollouts on the main thread, then trains, so it needs "
                        f"run.schedule sync (got {run_cfg.schedule})")
    engine, extra = split_node(config.rollout.engine, "rollout.engine")

    if is_server_launcher(registry.get("rollout_engine", engine["name"]).obj):
        problems.append(f"rollout.engine: engine {engine['name']!r} runs as a server of its own and cannot run in "
                        f"this process (cluster.local_mode); use rollout.engine.name=local")
    if extra["release_memory_during_train"]:
        problems.append("rollout.engine.release_memory_during_train: cluster.local_mode runs the engine in this "
                        "process, where it keeps its memory; set it to false")
    backend = component_node(config.backend)
    if uses_ray(registry.get("backend", backend["name"]).obj):
        problems.append(f"backend: {backend['name']!r} trains in Ray worker processes (backend.world_size="
                        f"{backend.get('world_size', 1)}) and cannot run in this process (cluster.local_mode); use "
                        f"backend.name=torch")
    return problems


def resolve_tool(registry: Registry, name: Any, where: str) -> Any:
    """The :class:`miles.Tool` registered as ``name`` (or at an import path; a plain function becomes a Tool)."""
    from miles.agentic.types import Tool, tool

    obj = registry.get("tool", name, where=where).obj
    return obj if isinstance(obj, Tool) else tool(obj)


def validate_config(config: DictConfig, registry: Registry) -> None:
    problems: list[str] = []
    for key, kind in COMPONENT_NODES.items():
        node = OmegaConf.select(config, key)
        if node is None and key in OPTIONAL_NODES:
            continue
        problems += _check_node(registry, kind, node, key)
    for key, kind in COMPONENT_LISTS.items():
        nodes = OmegaConf.select(config, key)
        if not isinstance(nodes, (ListConfig, list)):
            problems.append(f"{key}: expected a list of {kind} nodes ({{name: ..., args}}), got {nodes!r}")
            continue
        for i, node in enumerate(nodes):
            problems += _check_node(registry, kind, node, f"{key}[{i}]")
    problems += _range_problems(config)
    problems += _resource_problems(config.cluster) + _eval_problems(config.eval) + _distill_problems(config.distill)
    if config.data.train_path is None and config.data.generator is None:
        problems.append("data: set data.train_path (a JSONL or Parquet file) or data.generator (synthetic data)")
    if not problems:  # combinations are judged once each part is well-formed
        problems += conflicts(config, registry) + _agentic_problems(config, registry) + _schedule_problems(config)
        problems += _debug_problems(config, registry)
    if problems:
        raise ConfigError("Config is not well-formed, found the following errors:\n- " + "\n- ".join(problems))
