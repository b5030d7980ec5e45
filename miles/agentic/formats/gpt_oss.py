"""gpt_oss chat formats (to be written)."""

FORMATS = ()
TOOL_PARSERS: dict = {}
REASONING_PARSERS: dict = {}
