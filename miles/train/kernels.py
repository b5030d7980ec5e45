"""Log-prob kernels: the per-chunk log-softmax, target log-prob and entropy of the chunked path
(:func:`miles.train.logprobs.token_logprobs` with ``chunk_tokens > 0``), the builtin ``torch`` kernel, and
choosing a kernel by name in the process that computes.

Kernels are registered through ``miles_register_logprob_kernels`` (the hookspec's docstring is the
contract). Training workers (Ray actors) do not have the driver's registry, so each process looks the
name up in a registry of its own, built once from :func:`miles.plugins.build_plugin_manager` with this
one hook called (:func:`kernel_registry`).
"""

from __future__ import annotations

import difflib
import functools
import logging
from typing import TYPE_CHECKING, Protocol

from miles.errors import ConfigError
from miles.lazy import lazy_module

if TYPE_CHECKING:
    from miles.registry import Registry

torch = lazy_module("torch")

__all__ = ["LogprobKernel", "TorchKernel", "kernel_registry", "check_kernel_name", "select_kernel"]

log = logging.getLogger(__name__)

KIND = "logprob_kernel"
OPTION = "backend.logprob_kernel"
_warned: set[tuple[str, str, str]] = set()


class LogprobKernel(Protocol):
    """What ``miles_register_logprob_kernels`` factories return (see that hook for the contract)."""

    def unavailable(self, device: torch.device) -> str | None:
        """None when the kernel runs on ``device``; otherwise why not, in words."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``logits [n, V]`` float32 contiguous, ``targets [n]`` int64 -> log-probs, entropy, log-sum-exp ``[n]``."""

    def backward(self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                 grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None) -> torch.Tensor:
        """``grad_logits [n, V]`` float32; may be written into the logits' storage."""


class TorchKernel:
    """Registered as log-prob kernel ``torch``: torch ops, the reference and the fallback; runs anywhere.

    Over a vocabulary wider than ``vocab_block`` columns it works on column blocks (the log-sum-exp of
    each block, then of those), so its temporaries stay ``[n, vocab_block]`` beside the logits.
    """

    def __init__(self, vocab_block: int = 65536) -> None:
        if vocab_block < 1:
            raise ValueError(f"vocab_block must be >= 1, got {vocab_block}")
        self.vocab_block = vocab_block

    def unavailable(self, device: torch.device) -> str | None:
        return None

    def _blocks(self, vocab: int) -> list[slice]:
        return [slice(start, min(start + self.vocab_block, vocab)) for start in range(0, vocab, self.vocab_block)]

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        blocks = self._blocks(logits.shape[1])
        lse = torch.logsumexp(torch.stack([torch.logsumexp(logits[:, b], dim=-1) for b in blocks], dim=-1), dim=-1)
        entropy = torch.zeros_like(lse)
        for b in blocks:
            log_p = logits[:, b] - lse.unsqueeze(-1)
            entropy -= log_p.exp().mul_(log_p).sum(dim=-1)  # in place: no third [n, V] tensor
        logprobs = logits.gather(1, targets.unsqueeze(1)).squeeze(1) - lse
        return logprobs, entropy, lse

    def backward(self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                 grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None) -> torch.Tensor:
        # d logprob_t / d x_v = onehot - p_v;  d entropy / d x_v = -p_v (log p_v + entropy), so the gradient is
        # grad_lp onehot + p (c + d log p) with c = -(grad_lp + grad_ent entropy) and d = -grad_ent: in place.
        if grad_entropy is not None:
            c = -torch.addcmul(grad_logprobs, grad_entropy, entropy).unsqueeze(-1)
            d = -grad_entropy.unsqueeze(-1)
        for b in self._blocks(logits.shape[1]):
            block = logits[:, b].sub_(lse.unsqueeze(-1))  # log p
            if grad_entropy is None:
                block.exp_().mul_(-grad_logprobs.unsqueeze(-1))
            else:
                p = block.exp()
                torch.addcmul(c, block, d, out=block).mul_(p)
        return logits.scatter_add_(1, targets.unsqueeze(1), grad_logprobs.unsqueeze(1))


@functools.cache
def kernel_registry() -> Registry:
    """This process's log-prob kernels: every plugin's ``miles_register_logprob_kernels`` (builtins and
    installed entry points, as :func:`miles.plugins.build_plugin_manager` loads them), and no other hook."""
    from miles.plugins import build_plugin_manager
    from miles.registry import KINDS, Registry

    pm, registry, hook = build_plugin_manager(), Registry(), KINDS[KIND].hook
    impls = getattr(pm.hook, hook).get_hookimpls()
    for impl in sorted(impls, key=lambda impl: not pm.info[impl.plugin_name].builtin):  # builtins first
        register = functools.partial(registry.add, KIND, plugin=pm.info[impl.plugin_name])
        impl.function(**({"register": register} if "register" in impl.argnames else {}))
    return registry


def _factory(name: str, registry: Registry):
    try:
        return registry.get(KIND, name, where=OPTION).obj
    except ConfigError:
        if ":" in name:
            raise
        known = ["auto", *registry.names(KIND)]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{OPTION}: unknown log-prob kernel {name!r}; known: {', '.join(known)}{hint} (kernels come from "
            f"plugins through miles_register_logprob_kernels, e.g. 'triton' from miles-kernels; an import path "
            f"'package.module:attr' is accepted too)") from None


def check_kernel_name(name: str, registry: Registry | None = None) -> None:
    """Refuse a name that is neither ``auto`` nor a known kernel (:class:`ConfigError` naming the option)."""
    if name not in ("auto", "torch"):  # those two always exist: no plugin manager needed
        _factory(name, registry or kernel_registry())


def select_kernel(name: str, device: torch.device | str, registry: Registry | None = None) -> LogprobKernel:
    """The kernel to run on ``device`` for ``backend.logprob_kernel = name``.

    ``torch``: the reference. ``auto``: the first kernel other than ``torch`` (in name order) that runs
    on ``device``, else ``torch``. A named kernel that cannot run on ``device`` falls back to ``torch``
    with one warning per process that says why. An unknown name is a :class:`ConfigError`.
    """
    registry = registry or kernel_registry()
    device = torch.device(device)
    if name == "auto":
        for other in registry.names(KIND):
            if other == "torch":
                continue
            kernel = registry.get(KIND, other).obj()
            if kernel.unavailable(device) is None:
                log.info("%s auto: kernel %r on %s", OPTION, other, device)
                return kernel
        return registry.get(KIND, "torch").obj()
    kernel = _factory(name, registry)()
    reason = kernel.unavailable(device)
    if reason is None:
        return kernel
    if (name, str(device), reason) not in _warned:
        _warned.add((name, str(device), reason))
        log.warning("%s: kernel %r cannot run on %s (%s); using the torch kernel", OPTION, name, device, reason)
    return registry.get(KIND, "torch").obj()
