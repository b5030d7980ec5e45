"""How the algorithm's components fit together: defaults an estimator brings to the loss, and
combinations refused before the run starts (each message names the options that conflict)."""

from __future__ import annotations

import inspect
from typing import Any

from omegaconf import DictConfig, open_dict

from miles.config.schema import component_node
from miles.hookspecs import LossDefaults, NeedsRefLogprobs, NeedsValues
from miles.registry import Registry

__all__ = ["apply_estimator_defaults", "conflicts"]


def _obj(registry: Registry, kind: str, node: Any) -> Any:
    try:
        return registry.get(kind, component_node(node)["name"]).obj
    except Exception:  # noqa: BLE001 - an unknown name is reported by validate_config
        return None


def apply_estimator_defaults(config: DictConfig, registry: Registry) -> None:
    """Fill in the loss arguments the advantage estimator needs (its ``loss_defaults``) where the
    loss node does not set them, and the constant normaliser from the generation budget."""
    estimator = _obj(registry, "advantage", config.advantage)
    if isinstance(config.loss, str):
        config.loss = {"name": config.loss}
    loss = _obj(registry, "loss", config.loss)
    if loss is None:
        return
    accepted = set(inspect.signature(loss).parameters)
    with open_dict(config):
        for key, value in (estimator.loss_defaults if isinstance(estimator, LossDefaults) else {}).items():
            if key in accepted and key not in config.loss:
                config.loss[key] = value
        if (config.loss.get("agg") == "constant" and "norm_tokens" in accepted
                and config.loss.get("norm_tokens") is None):
            config.loss["norm_tokens"] = int(config.rollout.sampling.max_new_tokens)


def _needs_values(component: Any) -> bool:
    return isinstance(component, NeedsValues) and bool(component.needs_values)


def conflicts(config: DictConfig, registry: Registry) -> list[str]:
    """Combinations that cannot work, each as a message naming the options involved."""
    problems = []
    advantage, loss, backend = (component_node(config[key]) for key in ("advantage", "loss", "backend"))
    loss_fn = _obj(registry, "loss", config.loss)
    if advantage.get("name") == "dr_grpo":
        if advantage.get("whiten"):
            problems.append("advantage.whiten=true conflicts with advantage.name=dr_grpo: Dr. GRPO removes the std "
                            "normalisation that whitening brings back")
        if loss.get("agg", "constant") != "constant":
            problems.append(f"loss.agg={loss['agg']} conflicts with advantage.name=dr_grpo: Dr. GRPO needs the "
                            f"constant normaliser (loss.agg=constant)")
    if loss.get("tis", "none") != "none" and backend.get("old_logprobs", "rollout") != "recompute":
        problems.append(f"loss.tis={loss['tis']} needs backend.old_logprobs=recompute: truncated importance sampling "
                        f"weighs the trainer's old log-probs against the engine's, and with old_logprobs=rollout "
                        f"they are the same")
    if _needs_values(loss_fn) and not _needs_values(_obj(registry, "advantage", config.advantage)):
        problems.append(f"loss.name={loss.get('name')} needs a value model, which advantage.name="
                        f"{advantage.get('name')} does not train: use an estimator with one (advantage.name=ppo)")
    if isinstance(loss_fn, NeedsRefLogprobs) and loss_fn.needs_ref_logprobs and config.regularization.kl_coef <= 0:
        problems.append(f"loss.name={loss.get('name')} needs a reference model, which loads only with "
                        f"regularization.kl_coef > 0")
    for i, node in enumerate(map(component_node, config.selection)):
        if node.get("name") not in ("drop_equal_rewards", "dynamic_sampling"):
            continue
        needed = max(2, node.get("min_samples", 2))
        if config.rollout.n_samples < needed:
            problems.append(f"selection[{i}]={node['name']} with rollout.n_samples={config.rollout.n_samples} would "
                            f"discard every group forever (it keeps groups of at least max(2, min_samples) samples "
                            f"whose rewards differ): set rollout.n_samples >= {needed}")
    return problems
