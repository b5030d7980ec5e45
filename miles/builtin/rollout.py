"""Builtin rollout functions and tool-call parsers."""

from miles import hookimpl
from miles.agentic.tool_calls import HermesParser, PythonBlockParser
from miles.session.agent import Agent
from miles.rollout.multi_turn import MultiTurn
from miles.rollout.single_turn import single_turn


@hookimpl(trylast=True)
def miles_register_rollout_fns(register):
    register("single_turn", single_turn)
    register("multi_turn", MultiTurn)
    register("agent", Agent)


@hookimpl(trylast=True)
def miles_register_tool_parsers(register):
    register("hermes", HermesParser)
    register("python_block", PythonBlockParser)
