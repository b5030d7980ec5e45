"""The builtin chat formats, one module per model family.

Each module lists its formats in ``FORMATS``, its tool parsers in ``TOOL_PARSERS`` and its reasoning
parsers in ``REASONING_PARSERS`` (name -> factory); :mod:`miles.builtin.chat_formats` registers them.
Templates are written from each family's documented format and live in ``miles/templates``.
"""

FAMILIES = ("qwen", "deepseek", "llama", "mistral", "glm", "gpt_oss", "kimi")
