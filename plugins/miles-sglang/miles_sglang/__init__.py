"""Real SGLang servers as Miles rollout engines (``rollout.engine.name: sglang``)."""

from miles_sglang.launcher import SGLangLauncher, sglang_argv

__all__ = ["SGLangLauncher", "sglang_argv"]
