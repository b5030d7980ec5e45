"""Miles plugin for verifiers (Prime Intellect's environment library): verifiers envs as Miles agents whose
model calls go through Miles' session server, a verifiers taskset's rewards as a Miles reward, and its tasks as
Miles data. verifiers runs in a venv of its own (:mod:`miles_verifiers.venv`), driven by a worker process."""

from miles_verifiers.agent import rollout
from miles_verifiers.client import close_workers
from miles_verifiers.data import verifiers_tasks
from miles_verifiers.reward import VerifiersReward
from miles_verifiers.venv import ensure_venv

__all__ = ["rollout", "VerifiersReward", "verifiers_tasks", "close_workers", "ensure_venv"]
