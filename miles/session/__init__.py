"""Sessions: an OpenAI-compatible chat endpoint per trajectory for external agent harnesses, recording the
exact tokens behind each answer (see :mod:`miles.session.server` and docs/sessions.md)."""

from miles.lazy import lazy_exports

__all__ = ["Session", "SessionServer"]

__getattr__ = lazy_exports(__name__, {"Session": "miles.session.state", "SessionServer": "miles.session.server"})
