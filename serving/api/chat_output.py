"""Chat requests in, parsed chat output out: rendering with the model's template, and the streaming
parser compiled from it, fed with each request's text deltas (special tokens kept)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from beam_jax.tokenizer import STOP_TOKENS, render_chat
from serving.api.errors import ApiError
from serving.chat.parser import Event, StreamingParser, collect
from serving.chat.template_probe import learn_chat_format
from serving.engine import RequestOutput

CHAT_FORMAT = learn_chat_format(None, stop_tokens=STOP_TOKENS)  # Beam's shipped template


def render_prompt(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                  reasoning_effort: str | None) -> str:
    try:
        return render_chat(messages, tools=tools or None, reasoning_effort=reasoning_effort or "medium")
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as error:
        raise ApiError(400, f"the messages cannot be rendered with the chat template: {error}",
                       "invalid_request_error", param="messages") from error


class OutputStream:
    """One generation's parser. `feed(output)` takes each RequestOutput of the engine and returns
    the parsed events its delta decides; the stop token that ended generation is fed too (Beam's
    `<|call|>` closes a tool call)."""

    def __init__(self, tokenizer, tools: Sequence[Mapping[str, Any]] | None):
        self.tokenizer = tokenizer
        self.parser = StreamingParser(CHAT_FORMAT, tools=tools or None)
        self.events: list[Event] = []

    def feed(self, output: RequestOutput) -> list[Event]:
        events = self.parser.feed(output.new_text) if output.new_text else []
        if output.finished:
            completion = output.outputs[0]
            if completion.finish_reason == "stop" and completion.token_ids and completion.stop_reason is None:
                stop_text = self.tokenizer.decode([completion.token_ids[-1]], skip_special_tokens=False)
                events += self.parser.feed(stop_text)
            events += self.parser.finish()
        self.events += events
        return events

    def parsed(self):
        return collect(self.events)
