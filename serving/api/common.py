"""What the API routes share: the `Server` (engine, tokenizer, limits, metrics) and SSE helpers."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from serving.api.chat_output import CHAT_FORMAT
from serving.api.errors import ApiError
from serving.api.metrics import Metrics
from serving.async_engine import AsyncEngine, EngineDeadError
from serving.engine import RequestOutput
from serving.grammar import ChatGrammars, Grammar
from serving.sampling import SamplingParams

log = logging.getLogger(__name__)


class Server:
    """What every route needs: the engine, the tokenizer, the chat format and the metrics."""

    def __init__(self, engine: AsyncEngine, *, served_model_name: str, api_key: str | None = None):
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key
        llm = engine.engine
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.metrics = Metrics()
        self.created = int(time.time())
        self.grammar_backend = llm.grammar_backend  # made now: it imports xgrammar (and torch): seconds
        self.grammars = ChatGrammars(CHAT_FORMAT, self.grammar_backend.special_tokens)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           "model_not_found", param="model")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.engine.engine.vocab_size
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise ApiError(400, f"prompt token ids outside the vocabulary of {vocab}: {bad[:5]}",
                           "invalid_request_error", param="prompt")
        return list(ids)

    def output_grammar(self, tools: list[dict] | None, *, tool_choice: str = "auto", tool_name: str | None = None,
                       json_output: bool = False, json_schema: dict | bool | None = None,
                       parallel_tool_calls: bool = True, max_tokens: int) -> Grammar | None:
        """The grammar a chat turn must follow, or None. `tool_choice`: "auto", "required" or "named"
        (`tool_name`). A forced call wins over `json_output`; under "auto" the answer may be JSON or
        calls are constrained once started, not both (a JSON answer excludes calls). Forced forms may
        reason first for up to half of `max_tokens`, which leaves the other half to the constrained part."""
        forced = bool(tools) and tool_choice in ("required", "named")
        if not (forced or json_output or (tools and tool_choice == "auto")):
            return None
        try:
            if forced:
                grammar = self.grammars.forced_tool_calls(tools, name=tool_name, parallel=parallel_tool_calls,
                                                          reasoning_tokens=max_tokens // 2)
            elif json_output:
                grammar = self.grammars.json_output(json_schema, reasoning_tokens=max_tokens // 2)
            else:
                grammar = self.grammars.tool_calls_once_started(tools)
            if grammar is not None:
                self.grammar_backend.compile(grammar)
            return grammar
        # (TypeError, KeyError: schemas with fields of the wrong type, e.g. a non-integer maxLength)
        except (ValueError, TypeError, KeyError) as error:
            if not (forced or json_output):  # a tool schema the grammar cannot take: auto calls stay free
                log.warning("tool calls unconstrained: %s", error)
                return None
            message = str(error) if isinstance(error, ValueError) else f"the schema cannot be used: {error!r}"
            raise ApiError(400, message, "invalid_request_error",
                           param="tool_choice" if forced else "response_format") from error

    def limit_max_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ApiError(400, f"The prompt has {prompt_len} tokens but the context is {self.max_model_len}.",
                           "context_length_exceeded", param="messages")
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise ApiError(400, f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceed the context "
                           f"of {self.max_model_len}.", "context_length_exceeded", param="max_tokens")
        return max_tokens

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The engine's stream, with the server's metrics (TTFT, inter-token latency)."""
        started = time.monotonic()
        last = None
        self.metrics.requests_started += 1
        try:
            async for out in self.engine.generate(request_id, prompt_ids, params):
                if out.new_token_ids:
                    now = time.monotonic()
                    if last is None:
                        self.metrics.ttft.observe(now - started)
                    else:
                        self.metrics.inter_token.observe(now - last)
                    last = now
                yield out
        except ValueError as error:
            raise ApiError(400, str(error), "invalid_request_error") from error
        except EngineDeadError as error:
            raise ApiError(503, str(error), "engine_error") from error
        finally:
            self.metrics.requests_finished += 1


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def streaming(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def gather_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Runs n generations concurrently; the last output of each."""

    async def last(stream):
        final = None
        async for out in stream:
            final = out
        return final

    return list(await asyncio.gather(*(last(s) for s in streams)))


def content_text(content: Any) -> str:
    """OpenAI/Anthropic content: a string or a list of parts, of which text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") in ("text", "input_text"):
            texts.append(part.get("text", ""))
        else:
            raise ApiError(400, f"content parts of type {part.get('type')!r} are not supported (text only)",
                           "invalid_request_error", param="messages")
    return "".join(texts)

