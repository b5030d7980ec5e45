"""Sessions: an OpenAI-compatible chat endpoint per trajectory for external agent harnesses, recording the
exact tokens behind each answer (see :mod:`miles.session.server` and docs/sessions.md)."""

from miles.session.server import Session, SessionServer

__all__ = ["Session", "SessionServer"]
