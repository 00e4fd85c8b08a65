"""Chat output parsing compiled from the model's chat template (see template_probe and parser)."""

from serving.chat.chat_format import ChatFormat, JsonCallFormat, Marker, ParameterFormat, ToolCallFormat
from serving.chat.parser import (
    ContentDelta,
    Event,
    ParsedOutput,
    ReasoningDelta,
    StreamingParser,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    collect,
    parse,
)
from serving.chat.template_probe import beam_chat_format, learn_chat_format, render_with

__all__ = [
    "ChatFormat", "ContentDelta", "Event", "JsonCallFormat", "Marker", "ParameterFormat", "ParsedOutput",
    "ReasoningDelta", "StreamingParser", "ToolCall", "ToolCallArgumentsDelta", "ToolCallEnd", "ToolCallFormat",
    "ToolCallStart", "beam_chat_format", "collect", "learn_chat_format", "parse", "render_with",
]
