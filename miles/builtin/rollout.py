"""Builtin rollout functions and tool-call parsers."""

from miles import hookimpl


@hookimpl(trylast=True)
def miles_register_rollout_fns(register):
    register("single_turn", "miles.rollout.single_turn:single_turn")
    register("multi_turn", "miles.rollout.multi_turn:MultiTurn")
    register("agent", "miles.session.agent:Agent")


@hookimpl(trylast=True)
def miles_register_tool_parsers(register):
    register("hermes", "miles.agentic.tool_calls:HermesParser")
    register("python_block", "miles.agentic.tool_calls:PythonBlockParser")
