"""Builtin rollout engines: ``local`` (in process, or served by each engine actor) and ``miles_server``
(``miles engine serve`` in a process of its own, started by each engine actor)."""

from miles import hookimpl


@hookimpl(trylast=True)
def miles_register_rollout_engines(register):
    register("local", "miles.engine.local:LocalEngine")
    register("miles_server", "miles.engine.launchers:MilesServerLauncher")
