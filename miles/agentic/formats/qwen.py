"""Qwen: ChatML (Qwen2.5), Qwen3 with hybrid thinking, and QwQ.

Tool calls are Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` after the
content; results come back in a user turn, each inside ``<tool_response>``. Qwen3 and QwQ reason inside
``<think>...</think>`` at the start of an assistant turn.
"""

from miles.agentic.chat_format import ChatFormat, ThinkTagReasoning

CHATML = ChatFormat(
    name="chatml",
    description="ChatML with Hermes tool calls (Qwen2.5, and models fine-tuned on ChatML)",
    end_of_turn=("<|im_end|>",),
    tool_parser="hermes",
    template="chatml_tools",
    identify=("<|im_start|>",),
)

QWEN2_VL = ChatFormat(
    name="qwen2_vl",
    description="Qwen2-VL and Qwen2.5-VL: ChatML whose messages may hold images, Hermes tool calls",
    end_of_turn=("<|im_end|>",),
    tool_parser="hermes",
    template="qwen2_vl",
    identify=("<|im_start|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    template_markers=("<|vision_start|>",),  # Qwen2.5's text models hold the vision tokens too, not in their template
)

QWEN3 = ChatFormat(
    name="qwen3",
    description="Qwen3 hybrid thinking: <think> reasoning before the answer, enable_thinking to turn it off",
    end_of_turn=("<|im_end|>",),
    tool_parser="hermes",
    reasoning_parser="qwen3_think",
    reasoning_field="reasoning_content",
    template="qwen3",
    identify=("<|im_start|>", "<think>", "</think>"),
    template_markers=("enable_thinking",),
    template_kwargs={"enable_thinking": True},
    differs_from_deployment="keeps every turn's reasoning; the published template drops the reasoning of turns "
                            "before the last user message",
)

QWQ = ChatFormat(
    name="qwq",
    description="QwQ-32B: ChatML whose generation prompt opens <think>",
    end_of_turn=("<|im_end|>",),
    tool_parser="hermes",
    reasoning_parser="think_opened",
    reasoning_field="reasoning_content",
    always_reasons=True,
    template="qwq",
    identify=("<|im_start|>", "<think>", "</think>"),
    template_markers=("<|im_start|>assistant\\n<think>\\n",),
    differs_from_deployment="keeps every turn's reasoning; the published template keeps only the text after "
                            "</think> of earlier turns",
)

FORMATS = (CHATML, QWEN2_VL, QWEN3, QWQ)
TOOL_PARSERS: dict = {}
REASONING_PARSERS = {
    "qwen3_think": ThinkTagReasoning,
    "think_opened": lambda: ThinkTagReasoning(opened_by_prompt=True),
}
