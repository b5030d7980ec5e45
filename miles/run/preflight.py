"""Every check a run can make before it trains, made before anything under ``run.dir`` changes.

:func:`preflight` reads and checks the run directory, the data, the model, the checkpoint to resume
from and the resources; what it has to build (generated data, a model built from the config) goes to
a staging folder outside the run directory. ``miles config --check`` runs it too, so the two commands agree;
plain ``miles config`` makes only :func:`check_settings`, which needs no model and no data.
Only :meth:`Staged.commit`, called once every check has passed, writes into ``run.dir``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from miles.run.hub import is_hub_data, model_folder, stage_hub_split
from miles.run.lock import LOCK_NAME
from miles.run.checkpoint import Checkpoint, check_compatible, model_signature, newest_intact_checkpoint
from miles.config.schema import EvalDatasetConfig, EvalSamplingConfig
from miles.config.validate import component_node, split_node
from miles.loop.distill import check_teacher
from miles.errors import ConfigError, DataError
from miles.hookspecs import is_server_launcher
from miles.loop.evaluation import EvalSet, read_eval_sets
from miles.models.hf import build_model_dir, context_length, load_tokenizer, set_chat_template
from miles.rewards.labels import LabelNeed, label_need
from miles.models.vision import ImageEncoder
from miles.rollout.data_source import Prompt, check_labels, check_unknown_tokens, encode_rows, read_rows, where_in_file
from miles.run.placement import Target, check_machine
from miles.run.settings import check_settings, lora_options, trial_backends
from miles.train.prefix_tree import config_sharing_problem, parse_share_prefixes

__all__ = ["Staged", "chat_format", "eval_inputs", "preflight", "run_tokenizer"]


@dataclass
class Staged:
    """What the checks found and built; nothing of it is in ``run_dir`` before :meth:`commit`."""

    run_dir: Path
    staging: Path
    model_path: str  # the model the run starts from (staged when built from the config)
    tokenizer: Any
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    resume_from: Checkpoint | None
    ray_num_cpus: int | None  # CPUs for a local Ray instance, when the run uses Ray
    data_stats: dict[str, int] = field(default_factory=dict)
    eval_sets: list[EvalSet] = field(default_factory=list)  # the eval section's datasets, read
    chat_format: Any = None  # miles.agentic.chat_format.BoundFormat: how the model family talks (None: none fits)
    _staged_model: bool = False

    def commit(self, overwrite: bool) -> None:
        """Lay out the run directory: clear it (``run.overwrite``), move staged data and model in."""
        if overwrite and self.run_dir.is_dir():
            for entry in self.run_dir.iterdir():
                if entry.name == LOCK_NAME:  # this run's own
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        staged_data = self.staging / "data"
        if staged_data.is_dir():
            (self.run_dir / "data").mkdir(exist_ok=True)
            for file in staged_data.iterdir():
                shutil.move(file, self.run_dir / "data" / file.name)
        if self._staged_model:
            target = self.run_dir / "init_model"
            if not (target / "config.json").is_file():  # a resumed run keeps the model it was built with
                shutil.rmtree(target, ignore_errors=True)
                shutil.move(self.model_path, target)
            self.model_path = str(target)
        self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def _stage_data(p: Any, staging: Path) -> tuple[str, str | None]:
    cfg = p.config.data
    train_path, eval_path = cfg.train_path, cfg.eval_path
    if is_hub_data(train_path):  # a Hub dataset's split, kept in the run directory's data/
        train_path = str(stage_hub_split(train_path, cfg.hub_subset, cfg.train_split,
                                         staging / "data" / "train.parquet", "data.train_path"))
    if is_hub_data(eval_path):
        eval_path = str(stage_hub_split(eval_path, cfg.hub_subset, cfg.eval_split,
                                        staging / "data" / "eval.parquet", "data.eval_path"))
    if cfg.generator is None:
        return train_path, eval_path
    splits = p.build("data_generator", "data.generator")(int(p.config.run.seed))
    if "train" not in splits:
        raise DataError(f"data generator {cfg.generator.name!r} returned no 'train' split (got {', '.join(splits)})")
    (staging / "data").mkdir(exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        paths[split] = staging / "data" / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(train_path or paths["train"]), str(eval_path or paths.get("eval") or "") or None


def _stage_model(p: Any, staging: Path) -> tuple[str, bool]:
    path = p.config.model.path
    if path is not None:
        return model_folder(str(path)), False
    out = build_model_dir(p.config.model.build, p.config.model.tokenizer, staging / "init_model",
                          int(p.config.run.seed))
    return str(out), True


def _fit_context(prompts: list[Prompt], path: str, room: int, context: int, policy: str) -> tuple[list[Prompt], int]:
    """Prompts that leave ``room`` new tokens in the context; the others refused or dropped."""
    fits = [q for q in prompts if len(q.prompt_ids) + room <= context]
    over = len(prompts) - len(fits)
    if over and policy == "error":
        longest = max(prompts, key=lambda q: len(q.prompt_ids))
        raise DataError(
            f"data file {path!r}: {over} of {len(prompts)} prompt(s) leave no room for "
            f"rollout.sampling.max_new_tokens={room} in the model's context of {context} tokens (the longest, "
            f"{where_in_file(path, longest)}, has {len(longest.prompt_ids)} tokens; at most {context - room} fit). "
            f"Shorten them, lower max_new_tokens, or drop them with data.overlong_prompts=drop")
    if over and not fits:
        raise DataError(f"data file {path!r}: every prompt is longer than the context allows "
                        f"({context} tokens less max_new_tokens={room}); nothing is left to train on")
    return fits, over


def _check_routing(config: Any, model_path: str) -> None:
    """The engine's expert ids (for routing replay) need a mixture-of-experts model."""
    if config.rollout.return_routed_experts:
        model = json.loads((Path(model_path) / "config.json").read_text())
        if not any(model.get(key) for key in ("num_experts", "n_routed_experts", "num_local_experts")):
            raise ConfigError(f"rollout.return_routed_experts: the model ({model.get('model_type', 'unknown type')}) "
                              f"has no mixture-of-experts layers; set it to false, or use an MoE model "
                              f"(model.build.arch: qwen3_moe)")


def _check_share_prefixes(config: Any, model_path: str) -> None:
    """``backend.share_prefixes: true`` needs a model whose attention takes a tree mask (the backend's own check, on the
    loaded model, would come after run.dir is written)."""
    try:
        mode = parse_share_prefixes(component_node(config.backend).get("share_prefixes", "auto"))
    except ValueError:  # refused by the backend's option check already
        return
    if mode != "true":
        return
    from transformers import AutoConfig

    model = AutoConfig.from_pretrained(model_path)
    name = (model.architectures or [model.model_type])[0]
    if (problem := config_sharing_problem(model, name)) is not None:
        raise ConfigError(f"backend.share_prefixes: true: {problem}; set backend.share_prefixes to auto (such a "
                          f"model then trains unshared) or false")


def _check_lora(p: Any, model_path: str) -> None:
    """``backend.lora``: its target_modules fit the model (built on the meta device)."""
    from miles.train.lora import check_targets

    if (options := lora_options(p)) is not None:
        check_targets(model_path, options)


def _check_precision(p: Any, model_path: str) -> None:
    """``rollout.precision``, ``backend.qat`` and ``run.export_precision``: the libraries of their numerics are
    installed, and the scheme takes every layer it applies to (a model on the meta device)."""
    from miles.precision.checkpoint import check_stored_form, planned_layers
    from miles.precision.schemes import torchao_module

    check_stored_form(model_path)  # a model.path in a low-precision stored form: every scale there

    backend = p.config.backend
    nodes = {"rollout.precision": p.config.rollout.precision, "backend.qat": backend.get("qat"),
             "backend.precision": backend.get("precision"), "run.export_precision": p.config.run.export_precision}
    for where, node in nodes.items():
        if node is None or (scheme := p.registry.build("precision", component_node(node), where)) is None:
            continue
        try:
            torchao_module("quantization.quant_primitives")
            import compressed_tensors  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"{where}: {scheme.name} needs torchao and compressed-tensors: pip install "
                              f"'miles[precision]' ({exc})") from exc
        planned_layers(model_path, scheme, where)
        if where == "rollout.precision" and (lora := lora_options(p)) is not None and lora.sync == "adapters":
            raise ConfigError(f"rollout.precision: {scheme.name} engines hold quantized layers, into which LoRA "
                              f"adapters cannot be merged; set backend.lora.sync: merged (the trainer then pushes "
                              f"merged weights, quantized)")


def _check_engine(p: Any, model_path: str) -> None:
    """``rollout.engine``: the engine takes its arguments (built, nothing loaded or started: the same error as at
    the RL phase, before anything is written), and its speculative draft fits the model."""
    from miles.engine.speculative import SpeculativeConfig, check_draft

    args, _ = split_node(p.config.rollout.engine, "rollout.engine")
    engine = p.registry.build("rollout_engine", args, "rollout.engine")
    if (close := getattr(engine, "close", None)) is not None and not is_server_launcher(engine):
        close()
    if (spec := args.get("speculative")) is not None:
        try:
            check_draft(SpeculativeConfig.parse(spec), model_path)
        except ValueError as exc:
            raise ConfigError(f"rollout.engine: {exc}") from exc


def _check_placement(p: Any, model_path: str, target: Target | None) -> None:
    """The GPUs and their memory the run needs, against ``target`` (this machine unless the run joins a Ray
    cluster); the table is printed when the run takes GPUs or serves engines on Ray."""
    if target is None and p.config.cluster.address:
        return  # a cluster whose GPUs are known once joined: miles config --check --target describes one
    target = target if target is not None else Target.this_machine()
    table, takes_gpus = check_machine(p, trial_backends(p), target, model_path)
    _, extra = split_node(p.config.rollout.engine, "rollout.engine")
    if takes_gpus or extra.get("num_engines", 0):
        print(table, file=sys.stderr)


def _resume_checkpoint(run_dir: Path, p: Any, base_model: str, stack: list[dict[str, Any]]) -> Checkpoint | None:
    found, skipped = newest_intact_checkpoint(run_dir / "checkpoints")
    for problem in skipped:
        print(f"run.resume: skipping damaged checkpoint {problem}", file=sys.stderr)
    if found is None:
        if skipped:
            raise DataError(f"run.resume: no intact checkpoint under {run_dir / 'checkpoints'} ("
                            + "; ".join(skipped) + "). Start a new run, or run.overwrite=true to replace this one")
        print(f"run.resume: no checkpoint under {run_dir / 'checkpoints'}; starting from step 0", file=sys.stderr)
        return None
    check_compatible(found, model=model_signature(base_model), backend=p.config.backend.name, plugins=stack)
    if not Path(found.state["start_model"], "config.json").is_file():
        raise DataError(f"run.resume: checkpoint {found.path} continues from {found.state['start_model']}, "
                        f"which no longer exists")
    return found


def _check_traces(prompts: list[Prompt], tokenizer: Any, key: str, path: str, context: int) -> None:
    """Every SFT conversation (``sft.messages_key``) renders and fits the context."""
    from miles.loop.sft import conversation_sample

    for prompt in prompts:
        try:
            sample = conversation_sample(prompt, tokenizer, prompt.extra.get(key), key)
        except Exception as exc:
            raise DataError(f"data file {str(path)!r}, {where_in_file(path, prompt)}: sft.messages_key {key!r}: "
                            f"{exc if isinstance(exc, DataError) else f'{type(exc).__name__}: {exc}'}") from None
        if len(sample.prompt_ids) + len(sample.response_ids) > context:
            raise DataError(f"data file {str(path)!r}, {where_in_file(path, prompt)}: the conversation under {key!r} "
                            f"takes {len(sample.prompt_ids) + len(sample.response_ids)} tokens, more than the context "
                            f"of {context}")


def _check_prompt_data(p: Any, tokenizer: Any, files: list[tuple[str | None, list[Prompt]]], scored: bool,
                       sft: bool = False) -> int:
    """The prompts of each ``(path, prompts)`` against the tokenizer and what reads their labels: at most
    ``data.max_unk_prompt_frac`` of them hold text the tokenizer cannot encode; with ``scored`` (the reward will
    score them), each has a label the reward can score against when it needs one; with ``sft`` (the first file
    trains the SFT warm-up on its labels), each of the first file's has one. The first file's count of prompts
    with unknown tokens, for the summary."""
    config = p.config
    need = label_need(p.registry, component_node(config.reward)) if scored else None
    counts = []
    for i, (path, prompts) in enumerate(files):
        if path and prompts:
            counts.append(check_unknown_tokens(prompts, tokenizer, path, float(config.data.max_unk_prompt_frac)))
            if sft and i == 0:
                check_labels(prompts, path, config.data.label_key,
                             LabelNeed("sft", (str, int, float), who="the SFT warm-up (sft.steps > 0)"))
            if need is not None:
                check_labels(prompts, path, config.data.label_key, need)
    return counts[0] if counts else 0


def run_tokenizer(p: Any, model_path: str) -> Any:
    """The model's tokenizer, with ``model.chat_template`` as its chat template when set."""
    tokenizer = load_tokenizer(model_path)
    if p.config.model.chat_template:
        set_chat_template(tokenizer, p.config.model.chat_template, "model.chat_template")
    return tokenizer


def chat_format(p: Any, tokenizer: Any, model_path: str) -> Any:
    """``model.chat_format`` bound to the tokenizer (None when ``auto`` finds none), printed at start.

    The format's stop tokens are sent with every request of a trajectory, with the EOS ids of the checkpoint's
    ``generation_config.json``; ``model.chat_template`` (else the format's training template, else the tokenizer's
    own) renders every turn, with ``model.chat_template_kwargs``."""
    from miles.agentic.chat_format import bind, generation_eos_ids, resolve

    formats = {name: p.registry.get("chat_format", name).obj for name in p.registry.names("chat_format")}
    model = p.config.model
    try:
        fmt, line = resolve(formats, model.chat_format, tokenizer)
        if fmt is None:  # single-turn prompts only: nothing to say
            return None
        kwargs = OmegaConf.to_container(model.chat_template_kwargs) if model.chat_template_kwargs else {}
        bound = bind(fmt, tokenizer, template=tokenizer.chat_template if model.chat_template else None,
                     template_kwargs=kwargs, eos_ids=generation_eos_ids(model_path),
                     build_parser=lambda kind, name: p.registry.build(kind, {"name": name}, f"chat format {fmt.name}"))
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"model.chat_format: {exc}") from exc
    stops = ", ".join(tokenizer.convert_ids_to_tokens(list(bound.stop_ids)))
    print(f"{line}; stop tokens {stops}", file=sys.stderr)
    return bound


def scratch_folder(kind: str) -> Path:
    """A new folder of this process under $TMPDIR, ``miles-<kind>-<pid>-*``. Those of processes that are gone are
    removed first: a run killed while it set up leaves its folder, and nothing else would remove it."""
    for old in Path(tempfile.gettempdir()).glob(f"miles-{kind}-*-*"):
        pid = old.name.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"miles-{kind}-{os.getpid()}-"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def eval_inputs(p: Any, model_path: str) -> tuple[Any, list[EvalSet]]:
    """What ``miles eval`` needs: the model's tokenizer and the eval section's datasets (generated data is made in
    a folder removed afterwards). Without ``eval.datasets``, one dataset ``heldout``: the first ``run.eval_size``
    prompts of the held-out data, greedy, solved at ``run.eval_pass_reward`` (the figure ``miles train`` reports)."""
    if not (Path(model_path) / "config.json").is_file():
        raise ConfigError(f"--model {model_path!r} is not an HF model directory (no config.json there)")
    config = p.config
    if not config.eval.datasets:
        config = config.copy()
        config.eval.datasets = [EvalDatasetConfig(name="heldout", max_prompts=config.run.eval_size,
                                                  pass_reward=config.run.eval_pass_reward,
                                                  sampling=EvalSamplingConfig(temperature=0.0))]
    staging = scratch_folder("eval")
    try:
        _, eval_path = _stage_data(p, staging)
        tokenizer = run_tokenizer(p, model_path)
        eval_sets = read_eval_sets(config, tokenizer, eval_path, context_length(model_path),
                                   ImageEncoder.of(model_path))
        _check_prompt_data(p, tokenizer, [(ds.path or eval_path, es.prompts)
                                          for ds, es in zip(config.eval.datasets, eval_sets)], scored=True)
        return tokenizer, eval_sets
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def preflight(p: Any, stack: list[dict[str, Any]], target: Target | None = None) -> Staged:
    """Check everything that can be checked without training; build what must be built, outside run.dir.
    ``target``: the machine or declared cluster the run must fit (:mod:`miles.run.placement`; default this machine,
    none when the run joins a Ray cluster)."""
    config, run_cfg = p.config, p.config.run
    run_dir, ray_num_cpus = check_settings(p)
    staging = scratch_folder("staging")
    try:
        train_path, eval_path = _stage_data(p, staging)
        model_path, staged_model = _stage_model(p, staging)
        tokenizer = run_tokenizer(p, model_path)
        bound_format = chat_format(p, tokenizer, model_path)
        data_cfg = config.data
        encode = dict(prompt_key=data_cfg.prompt_key, chat_template=data_cfg.chat_template)
        label_key = data_cfg.label_key if config.sft.steps > 0 else None  # SFT needs labels; RL rewards may not
        images = ImageEncoder.of(model_path)  # None: a text-only model, whose data may hold no images
        encode["images"] = images
        train_prompts = encode_rows(read_rows(train_path, data_cfg.prompt_key, label_key, images is not None),
                                    tokenizer, label_key=data_cfg.label_key, **encode)
        _check_routing(config, model_path)
        _check_share_prefixes(config, model_path)
        check_teacher(config.distill, model_path)
        _check_lora(p, model_path)
        _check_precision(p, model_path)
        _check_engine(p, model_path)
        _check_placement(p, model_path, target)
        context, room = context_length(model_path), int(config.rollout.sampling.max_new_tokens)
        policy = data_cfg.overlong_prompts
        train_prompts, dropped = _fit_context(train_prompts, train_path, room, context, policy)
        if config.sft.steps > 0 and config.sft.messages_key:
            _check_traces(train_prompts, bound_format or tokenizer, config.sft.messages_key, train_path, context)
        eval_prompts: list[Prompt] = []
        dropped_eval = 0
        if eval_path and run_cfg.eval_size > 0 and run_cfg.steps > 0:
            rows = read_rows(eval_path, data_cfg.prompt_key, None, images is not None)[: run_cfg.eval_size]
            eval_prompts = encode_rows(rows, tokenizer, label_key=data_cfg.label_key, **encode)
            eval_prompts, dropped_eval = _fit_context(eval_prompts, eval_path, room, context, policy)
        for count, path in ((dropped, train_path), (dropped_eval, eval_path)):
            if count:
                print(f"data: dropped {count} prompt(s) of {path} longer than the context of {context} tokens less "
                      f"max_new_tokens={room} (data.overlong_prompts=drop)", file=sys.stderr)
        eval_sets = read_eval_sets(config, tokenizer, eval_path, context, images) if run_cfg.steps > 0 else []
        unk_prompts = _check_prompt_data(p, tokenizer, [(train_path, train_prompts), (eval_path, eval_prompts)] + [
            (ds.path or eval_path, es.prompts) for ds, es in zip(config.eval.datasets, eval_sets)], run_cfg.steps > 0,
            sft=config.sft.steps > 0 and not config.sft.messages_key)
        resume_from = _resume_checkpoint(run_dir, p, model_path, stack) if run_cfg.resume else None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Staged(run_dir, staging, model_path, tokenizer, train_prompts, eval_prompts, resume_from, ray_num_cpus,
                  {"data/dropped_prompts": dropped, "data/dropped_eval_prompts": dropped_eval,
                   "data/unk_prompts": unk_prompts}, eval_sets, bound_format,
                  staged_model)
