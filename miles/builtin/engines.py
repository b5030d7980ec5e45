"""Builtin rollout engines: ``local`` (in process, or served by each engine actor) and ``miles_server``
(``miles engine serve`` in a process of its own, started by each engine actor)."""

from miles import hookimpl
from miles.engine.local import LocalEngine
from miles.engine.launchers import MilesServerLauncher


@hookimpl(trylast=True)
def miles_register_rollout_engines(register):
    register("local", LocalEngine)
    register("miles_server", MilesServerLauncher)
