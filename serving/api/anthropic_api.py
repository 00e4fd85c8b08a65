"""Anthropic Messages route: `/v1/messages`, with content blocks (text, thinking, tool_use,
tool_result) and streaming events in Anthropic's order (message_start, then per block
content_block_start / deltas / content_block_stop, then message_delta and message_stop)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI

from serving.api.chat_output import OutputStream, render_prompt
from serving.api.common import Server, new_id, streaming
from serving.api.errors import ApiError, anthropic_error
from serving.api.protocol import MessagesRequest
from serving.chat.parser import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from serving.sampling import SamplingParams


def _text(blocks) -> str:
    if isinstance(blocks, str):
        return blocks
    return "".join(b.get("text", "") for b in blocks if b.get("type") == "text")


def openai_messages(body: MessagesRequest) -> list[dict]:
    """Anthropic messages as the OpenAI-style messages the chat template takes."""
    messages = [{"role": "system", "content": _text(body.system)}] if body.system else []
    for message in body.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        text, reasoning, calls = [], [], []
        for block in message.content:
            kind = block.get("type")
            if kind == "text":
                text.append(block.get("text", ""))
            elif kind == "thinking":
                reasoning.append(block.get("thinking", ""))
            elif kind == "tool_use" and message.role == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": block.get("input", {})}})
            elif kind == "tool_result" and message.role == "user":
                content = block.get("content", "")
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                 "content": _text(content) if not isinstance(content, str) else content})
            elif kind != "redacted_thinking":
                raise ApiError(400, f"content block type {kind!r} is not supported in a {message.role} message",
                               "invalid_request_error", param="messages")
        if text or reasoning or calls:
            entry = {"role": message.role, "content": "".join(text)}
            if reasoning:
                entry["reasoning_content"] = "".join(reasoning)
            if calls:
                entry["tool_calls"] = calls
            messages.append(entry)
    return messages


def _stop_reason(completion, has_calls: bool) -> tuple[str, str | None]:
    if completion.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest):
        server.check_model(body.model)
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.input_schema}} for t in body.tools or []] or None
        if body.tool_choice and body.tool_choice.get("type") == "none":
            tools = None
        effort = "high" if body.thinking and body.thinking.get("type") == "enabled" else None
        prompt_ids = server.encode(render_prompt(openai_messages(body), tools, effort))
        max_tokens = server.limit_max_tokens(len(prompt_ids), body.max_tokens)
        choice = body.tool_choice or {}
        grammar = server.output_grammar(
            tools, tool_choice={"any": "required", "tool": "named"}.get(choice.get("type"), "auto"),
            tool_name=choice.get("name"), parallel_tool_calls=not choice.get("disable_parallel_tool_use", False),
            max_tokens=max_tokens)
        try:
            params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k or 0,
                                    max_tokens=max_tokens, stop=tuple(body.stop_sequences or ()), grammar=grammar)
        except ValueError as error:
            raise ApiError(400, str(error), "invalid_request_error") from error
        message_id = new_id("msg")
        stream = server.generate(message_id, prompt_ids, params)
        if body.stream:
            return streaming(_events(server, message_id, stream, tools, len(prompt_ids)))
        final = None
        async for out in stream:
            final = out
        parser = OutputStream(server.tokenizer, tools)
        parser.feed(dataclasses.replace(final, new_text=final.outputs[0].text))
        parsed = parser.parsed()
        content = []
        if parsed.reasoning:
            content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content or not parsed.tool_calls:
            content.append({"type": "text", "text": parsed.content})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in parsed.tool_calls]
        completion = final.outputs[0]
        stop_reason, stop_sequence = _stop_reason(completion, bool(parsed.tool_calls))
        return {"id": message_id, "type": "message", "role": "assistant", "model": server.model_name,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(completion.token_ids)}}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind} | data, ensure_ascii=False)}\n\n"


async def _events(server: Server, message_id: str, stream, tools, prompt_tokens: int) -> AsyncIterator[str]:
    yield _event("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": server.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
    yield _event("ping", {})
    parser = OutputStream(server.tokenizer, tools)
    index, open_kind, has_calls, final = -1, None, False, None

    def open_block(kind: str, block: dict):
        nonlocal index, open_kind
        events = [_event("content_block_stop", {"index": index})] if open_kind else []
        index, open_kind = index + 1, kind
        return events + [_event("content_block_start", {"index": index, "content_block": block})]

    try:
        async for out in stream:
            final = out
            for event in parser.feed(out):
                if isinstance(event, ReasoningDelta):
                    if open_kind != "thinking":
                        for e in open_block("thinking", {"type": "thinking", "thinking": ""}):
                            yield e
                    yield _event("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                                   "thinking": event.text}})
                elif isinstance(event, ContentDelta):
                    if open_kind != "text":
                        for e in open_block("text", {"type": "text", "text": ""}):
                            yield e
                    yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta",
                                                                                   "text": event.text}})
                elif isinstance(event, ToolCallStart):
                    has_calls = True
                    for e in open_block("tool_use", {"type": "tool_use", "id": event.id, "name": event.name,
                                                     "input": {}}):
                        yield e
                elif isinstance(event, ToolCallArgumentsDelta):
                    yield _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                                   "partial_json": event.text}})
                elif isinstance(event, ToolCallEnd):
                    yield _event("content_block_stop", {"index": index})
                    open_kind = None
    except ApiError as error:
        yield _event("error", anthropic_error(error))
        return
    if open_kind:
        yield _event("content_block_stop", {"index": index})
    elif index < 0:  # always at least one (empty) text block, as Anthropic sends
        yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        yield _event("content_block_stop", {"index": 0})
    completion = final.outputs[0]
    stop_reason, stop_sequence = _stop_reason(completion, has_calls)
    yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                   "usage": {"output_tokens": len(completion.token_ids)}})
    yield _event("message_stop", {})
