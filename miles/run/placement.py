"""Where a run's processes go, and whether a machine can hold them: ``miles config`` prints the table, and
``miles config --check`` and ``miles train`` refuse, before anything starts, a run the machine (or, with ``miles
config --check --target cluster.yaml``, a declared cluster) cannot hold.

The rule (docs/cluster.md): each engine served over Ray takes its launcher's GPUs on one node (an SGLang server
``tp_size``; ``miles_server`` with ``device: cuda`` one), each worker of a Ray backend (``fsdp2``, ``megatron``) one
GPU when it trains on GPUs, and an in-process engine or backend on ``cuda`` one GPU of the driver's machine. Ray
packs each group (the engines, the workers) onto the nodes in order, as its ``PACK`` placement groups do; a group
that does not fit is refused with the numbers.

Memory, per GPU, estimated from the model's parameter count (a model on the meta device: nothing is loaded):
an engine holds its share of the weights in the rollout precision's bytes (the KV cache takes what is left, as
SGLang's ``mem_fraction_static`` says); a trainer its share of float32 master weights, gradients and AdamW's two
moments (16 bytes a parameter; ``fsdp2`` shards them over its workers) and the activations of a micro-batch
(34 bytes per token, hidden unit and layer in 16-bit, without recomputation: Korthikanti et al., 2022).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.config.validate import component_node, split_node
from miles.engine.launchers import SubprocessLauncher
from miles.errors import ConfigError
from miles.hookspecs import is_server_launcher, uses_ray

__all__ = ["Demand", "NodeSpec", "Target", "check_machine", "demands", "place", "placement_table", "refused_pairs"]

GIB = 1 << 30
_WEIGHT_BYTES = {"bf16": 2.0, "fp8_block": 1.0, "fp8_channel": 1.0, "mxfp8": 1.03, "int4_w4a16": 0.56, "nvfp4": 0.56}
_TRAIN_BYTES = 16.0  # float32 weights, gradients and AdamW's two moments, per parameter
_ACTIVATION_BYTES = 34.0  # per token, hidden unit and layer (16-bit, no recomputation)
_HEADROOM = 0.9  # of a GPU's memory a process may plan to fill (the CUDA context, fragmentation)


@dataclass(frozen=True)
class NodeSpec:
    gpus: int
    gpu_memory_gib: float = 0.0
    gpu_model: str = ""


@dataclass(frozen=True)
class Target:
    nodes: tuple[NodeSpec, ...]
    where: str  # "this machine", or the declaration's file

    @classmethod
    def this_machine(cls) -> Target:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        memory = torch.cuda.get_device_properties(0).total_memory / GIB if count else 0.0
        model = torch.cuda.get_device_name(0) if count else ""
        return cls((NodeSpec(count, memory, model),), "this machine")

    @classmethod
    def read(cls, path: str | Path) -> Target:
        """A declared cluster: ``nodes: [{count: 8, gpus: 8, gpu_memory_gib: 80, gpu_model: H100}, ...]``."""
        import yaml

        try:
            declared = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"--target {path}: cannot read it ({exc})") from None
        groups = declared.get("nodes") if isinstance(declared, dict) else None
        if not isinstance(groups, list) or not groups:
            raise ConfigError(f"--target {path}: expected a mapping with a list 'nodes' of "
                              f"{{count, gpus, gpu_memory_gib, gpu_model}}, got {declared!r}")
        nodes: list[NodeSpec] = []
        for i, group in enumerate(groups):
            where = f"--target {path}: nodes[{i}]"
            if not isinstance(group, dict) or set(group) - {"count", "gpus", "gpu_memory_gib", "gpu_model"}:
                raise ConfigError(f"{where}: expected {{count, gpus, gpu_memory_gib, gpu_model}}, got {group!r}")
            count, gpus, memory = group.get("count", 1), group.get("gpus", 0), group.get("gpu_memory_gib", 0)
            for name, value in (("count", count), ("gpus", gpus)):
                if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "count" else 0):
                    raise ConfigError(f"{where}.{name}: expected a whole number >= {1 if name == 'count' else 0}, "
                                      f"got {value!r}")
            if isinstance(memory, bool) or not isinstance(memory, (int, float)) or memory < 0 or (gpus and not memory):
                raise ConfigError(f"{where}.gpu_memory_gib: expected each GPU's memory in GiB (> 0 with gpus), "
                                  f"got {memory!r}")
            nodes += [NodeSpec(gpus, float(memory), str(group.get("gpu_model", "")))] * count
        return cls(tuple(nodes), str(path))


@dataclass(frozen=True)
class Demand:
    """``count`` processes of one kind, each with ``gpus`` GPUs on one node and ``memory_gib`` planned on each."""

    role: str
    count: int
    gpus: int
    key: str  # what sets it
    memory_gib: float | None = None
    memory: str = ""  # the estimate's parts
    in_driver: bool = False  # in the run's own process: an in-process engine and trainer share its GPU


def _engine_demand(p: Any, params: int | None) -> Demand:
    from miles.rollout.assemble import engine_launcher

    args, extra = split_node(p.config.rollout.engine, "rollout.engine")
    count = 0 if p.config.cluster.local_mode else int(extra.get("num_engines", 0))
    if count:
        gpus = int(math.ceil(float(getattr(engine_launcher(p, args), "gpus", 0.0))))
        key = "rollout.engine.tp_size" if "tp_size" in args else "rollout.engine.device"
        role = f"engine ({args['name']})"
    else:
        gpus, key, role, count = (1 if args.get("device") == "cuda" else 0), "rollout.engine.device", \
            f"engine ({args['name']}, in process)", 1
    in_driver = not count or p.config.cluster.local_mode or not extra.get("num_engines", 0)
    if not gpus:
        return Demand(role, count, 0, key, in_driver=in_driver)
    precision = component_node(p.config.rollout.precision).get("name", "bf16")
    if params is None:
        return Demand(role, count, gpus, key, in_driver=in_driver)
    per_gpu = params * _WEIGHT_BYTES.get(precision, 2.0) / gpus / GIB
    share = f", 1/{gpus} each" if gpus > 1 else ""
    return Demand(role, count, gpus, key, per_gpu,
                  f"weights {per_gpu:.2f} GiB ({precision}{share}) + the KV cache in what is left", in_driver)


def _trainer_demand(p: Any, backend: Any, target: Target, params: int | None, model: Any,
                    engine_in_driver: bool) -> Demand:
    options = backend.options
    device = getattr(options, "device", "auto")
    on_gpu = device == "cuda" or (device == "auto" and any(n.gpus for n in target.nodes))
    name = component_node(p.config.backend)["name"]
    ray = uses_ray(backend)
    count, role = (int(backend.world_size), f"trainer worker ({name})") if ray else (1, f"trainer ({name})")
    in_driver = not ray and engine_in_driver
    if not on_gpu:
        return Demand(role, count, 0, "backend.device", in_driver=in_driver)
    if params is None or model is None:
        return Demand(role, count, 1, "backend.device", in_driver=in_driver)
    shards = count if name == "fsdp2" else 1
    state = params * _TRAIN_BYTES / shards / GIB
    text = model.get_text_config()
    per_sample = int(p.config.rollout.sampling.max_new_tokens) + _prompt_tokens(text)
    tokens = int(options.micro_batch_size) * per_sample
    activations = tokens * int(text.hidden_size) * int(text.num_hidden_layers) * _ACTIVATION_BYTES / GIB
    share = f", 1/{shards} each" if shards > 1 else ""
    return Demand(role, count, 1, "backend.device", state + activations,
                  f"weights, gradients and AdamW state {state:.2f} GiB (16 B a parameter{share}) + activations "
                  f"{activations:.2f} GiB (a micro-batch of {options.micro_batch_size} x {per_sample} tokens)",
                  in_driver)


def _prompt_tokens(text_config: Any) -> int:
    """A prompt's tokens for the activation estimate: an eighth of the context, at most 1024."""
    return min(1024, int(getattr(text_config, "max_position_embeddings", 2048)) // 8)


def demands(p: Any, backend: Any, target: Target, model_path: str | None = None) -> list[Demand]:
    """The processes of the run that take GPUs or would, engines first (they are placed first); with
    ``model_path``, each with its memory estimate."""
    params, model = None, None
    if model_path is not None:
        params, model = _parameters(model_path)
    engine = _engine_demand(p, params)
    return [engine, _trainer_demand(p, backend, target, params, model, engine.in_driver)]


def _parameters(model_path: str) -> tuple[int, Any]:
    """The parameter count of the model at ``model_path`` (built on the meta device), and its config."""
    from miles.models import hf

    model = hf.model_on_meta(model_path)
    return sum(t.numel() for t in model.parameters()), model.config


def place(found: list[Demand], target: Target) -> list[tuple[str, int, str]]:
    """Each process's (name, node, GPUs), packing each group onto the nodes in order; a ConfigError with the
    numbers when one does not fit (GPUs, or the memory it plans on each)."""
    free = [node.gpus for node in target.nodes]
    rows: list[tuple[str, int, str]] = []
    driver: tuple[int, str] | None = None  # the GPU of the run's own process, once one of its parts took it
    driver_memory = sum(d.memory_gib or 0.0 for d in found if d.in_driver and d.gpus)
    for demand in found:
        if demand.gpus == 0:
            rows += [(f"{demand.role} {i}", -1, "CPU") for i in range(demand.count)]
            continue
        memory = max((n.gpu_memory_gib for n in target.nodes), default=0.0)
        planned = driver_memory if demand.in_driver else demand.memory_gib
        if demand.memory_gib is not None and memory and planned > _HEADROOM * memory:
            shared = " (with what shares the run's own process and its GPU)" if demand.in_driver else ""
            raise ConfigError(f"{demand.key}: each {demand.role} plans {demand.memory_gib:.3g} GiB on each of its "
                              f"GPUs ({demand.memory}){shared}; {target.where}'s GPUs have {memory:.3g} GiB "
                              f"({_HEADROOM:.0%} usable). Spread it over more GPUs, or lower its precision or "
                              f"micro-batch")
        if demand.in_driver and driver is not None:
            rows.append((f"{demand.role} 0", *driver))
            continue
        for i in range(demand.count):
            node = next((n for n, left in enumerate(free) if left >= demand.gpus), None)
            if node is None:
                total = sum(n.gpus for n in target.nodes)
                asked = sum(d.count * d.gpus for d in found)
                largest = max((n.gpus for n in target.nodes), default=0)
                why = (f"no node has {demand.gpus} free GPUs left (the largest has {largest})"
                       if demand.gpus > largest else f"the run asks {asked} GPUs and {target.where} has {total}")
                raise ConfigError(f"{demand.key}: {demand.count} x {demand.role} at {demand.gpus} GPU(s) each do not "
                                  f"fit {target.where}: {why}. {_layout(found)}")
            start = target.nodes[node].gpus - free[node]
            free[node] -= demand.gpus
            rows.append((f"{demand.role} {i}", node, ",".join(str(g) for g in range(start, start + demand.gpus))))
            if demand.in_driver:
                driver = rows[-1][1:]
    return rows


def _layout(found: list[Demand]) -> str:
    return "Asked: " + "; ".join(f"{d.count} x {d.role}, {d.gpus} GPU(s) each ({d.key})" for d in found)


def placement_table(found: list[Demand], rows: list[tuple[str, int, str]], target: Target) -> str:
    """Which process runs on which node and GPUs, with each kind's memory estimate."""
    lines = [f"placement on {target.where} ({len(target.nodes)} node(s), "
             f"{sum(n.gpus for n in target.nodes)} GPU(s)):"]
    width = max((len(name) for name, _, _ in rows), default=8)
    for name, node, gpus in rows:
        where = "CPU" if node < 0 else f"node {node}, GPU {gpus}"
        lines.append(f"  {name.ljust(width)}  {where}")
    for demand in found:
        if demand.memory_gib is not None:
            lines.append(f"  each {demand.role}: {demand.memory_gib:.2f} GiB a GPU: {demand.memory}")
    return "\n".join(lines)


def check_machine(p: Any, backend: Any, target: Target, model_path: str | None = None) -> tuple[str, bool]:
    """Refuse (ConfigError naming the key) a run ``target`` cannot hold: GPUs that are not there, a group that
    does not fit, a process whose memory does not; on this machine, packages the engine needs that it lacks.
    Returns the placement table, and whether the run takes any GPU."""
    if target.where == "this machine":
        _check_packages(p)
    found = demands(p, backend, target, model_path)
    needs_gpu = [d for d in found if d.gpus]
    if needs_gpu and not any(n.gpus for n in target.nodes):
        first = needs_gpu[0]
        cuda = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f" (CUDA_VISIBLE_DEVICES={cuda!r})" if cuda is not None else ""
        raise ConfigError(f"{first.key}: {first.role} needs {first.gpus} GPU(s) and {target.where} has none"
                          f"{hidden}: torch sees no CUDA or ROCm device. Run it where GPUs are, check it against "
                          f"the cluster it is for (miles config --check --target cluster.yaml), or set it to cpu. "
                          f"{_layout(found)}")
    return placement_table(found, place(found, target), target), bool(needs_gpu)


def refused_pairs(p: Any) -> None:
    """Options that work alone and not together, refused before anything starts (and before anything heavy is
    imported): a weight transport that cannot reach the engines' servers."""
    args, extra = split_node(p.config.rollout.engine, "rollout.engine")
    transport = component_node(p.config.rollout.weight_sync).get("name", "auto")
    if transport not in ("tensor", "shm") or not extra.get("num_engines", 0):
        return
    launcher = p.registry.get("rollout_engine", args["name"]).obj  # its class: what it serves with
    if is_server_launcher(launcher) and getattr(launcher, "protocol", None) == "sglang":
        raise ConfigError(f"rollout.weight_sync: {transport!r} cannot update SGLang servers (rollout.engine: "
                          f"{args['name']}): SGLang's /update_weights_from_tensor takes handles to tensors in the "
                          f"sender's GPU memory, not bytes, and it has no shared-memory endpoint. Use disk, "
                          f"distributed, or auto (disk for SGLang servers)")


def _check_packages(p: Any) -> None:
    """What the engine's servers need of this machine (``SubprocessLauncher.missing_packages``)."""
    from miles.rollout.assemble import engine_launcher

    args, extra = split_node(p.config.rollout.engine, "rollout.engine")
    if not extra.get("num_engines", 0) or not is_server_launcher(p.registry.get("rollout_engine", args["name"]).obj):
        return
    launcher = engine_launcher(p, args)
    if isinstance(launcher, SubprocessLauncher) and (missing := launcher.missing_packages()):
        raise ConfigError(f"rollout.engine: {args['name']} needs {'; '.join(missing)}")
