"""Miles plugin for verifiers (Prime Intellect's environment library): verifiers envs as Miles agents whose
model calls go through Miles' session server, a verifiers taskset's rewards as a Miles reward, and its tasks as
Miles data. verifiers runs in a venv of its own (:mod:`miles_verifiers.venv`), driven by a worker process."""

import miles

# imported when first used: loading the plugin's entry point imports none of their dependencies
__getattr__ = miles.lazy_exports(__name__, {
    "rollout": "miles_verifiers.agent",
    "close_workers": "miles_verifiers.client",
    "verifiers_tasks": "miles_verifiers.data",
    "VerifiersReward": "miles_verifiers.reward",
    "ensure_venv": "miles_verifiers.venv",
})

__all__ = ["rollout", "VerifiersReward", "verifiers_tasks", "close_workers", "ensure_venv"]
