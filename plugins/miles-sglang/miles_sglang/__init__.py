"""Real SGLang servers as Miles rollout engines (``rollout.engine.name: sglang``)."""

import miles

# imported when first used: loading the plugin's entry point imports none of their dependencies
__getattr__ = miles.lazy_exports(__name__, {
    "SGLangLauncher": "miles_sglang.launcher",
    "sglang_argv": "miles_sglang.launcher",
})

__all__ = ["SGLangLauncher", "sglang_argv"]
