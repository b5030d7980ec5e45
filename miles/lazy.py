"""Importing heavy packages when they are first used, not when Miles is imported: commands that only look or check
(``miles plugins``, ``miles config``) then start without torch, transformers or aiohttp (tests/test_light_imports.py).

``torch = lazy_module("torch")`` at a module's top binds a stand-in that imports torch on its first attribute read
(``torch.tensor``, ``torch.Tensor``), then holds each attribute it was asked for. Code that runs at import time (a
decorator, a module constant) must not read it: that would import the package there."""

from __future__ import annotations

import importlib
import types
from collections.abc import Mapping
from typing import Any

__all__ = ["lazy_module", "lazy_exports"]


class _LazyModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:  # only for names not read before
        value = getattr(importlib.import_module(self.__name__), attr)
        setattr(self, attr, value)
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self.__name__!r}>"


def lazy_module(name: str) -> Any:
    """A stand-in for module ``name`` (``"torch"``, ``"torch.nn.functional"``) that imports it when first used."""
    return _LazyModule(name)


def lazy_exports(package: str, exports: Mapping[str, str]) -> Any:
    """A module ``__getattr__`` (PEP 562) for ``package`` that imports each name of ``exports`` (name -> the module
    that defines it) when it is first read: a plugin package re-exports its components without importing their
    dependencies when Miles loads its entry point. ``__getattr__ = miles.lazy_exports(__name__, {...})``."""
    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)
    return __getattr__
