"""Registers the builtin tool ``execute_python_code`` and the ``tool_env`` environment
(:mod:`miles.agentic.tool_env`)."""

from miles import hookimpl


@hookimpl(trylast=True)
def miles_register_tools(register):
    register("execute_python_code", "miles.agentic.tool_env:execute_python_code")


@hookimpl(trylast=True)
def miles_register_envs(register):
    register("tool_env", "miles.agentic.tool_env:ToolEnv")
