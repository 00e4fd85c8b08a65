"""OpenAI routes: `/v1/chat/completions` and `/v1/completions`, streamed (SSE) or not."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI

from serving.api.chat_output import OutputStream, render_prompt
from serving.api.common import Server, content_text, gather_outputs, new_id, sse, streaming
from serving.api.errors import ApiError, openai_error
from serving.api.protocol import ChatCompletionRequest, CompletionRequest
from serving.chat.parser import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallStart
from serving.engine import RequestOutput
from serving.sampling import SamplingParams


def sampling_params(body, max_tokens: int, seed_offset: int, logprobs: int | None, grammar=None) -> SamplingParams:
    seed = None if body.seed is None else body.seed + seed_offset
    try:
        return SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k or 0, min_p=body.min_p,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, seed=seed, max_tokens=max_tokens,
            stop=tuple(body.stop or ()), ignore_eos=body.ignore_eos, logprobs=logprobs, grammar=grammar,
        )
    except ValueError as error:
        raise ApiError(400, str(error), "invalid_request_error") from error


def _output_grammar(server: Server, body: ChatCompletionRequest, tools, max_tokens: int):
    """response_format and tool_choice as a grammar (serving/grammar.py), or None."""
    response_format = body.response_format or {}
    named = body.tool_choice.get("function", {}).get("name") if isinstance(body.tool_choice, dict) else None
    return server.output_grammar(
        tools, tool_choice="named" if named else (body.tool_choice or "auto"), tool_name=named,
        json_output=response_format.get("type") in ("json_object", "json_schema"),
        json_schema=(response_format.get("json_schema") or {}).get("schema"),
        parallel_tool_calls=body.parallel_tool_calls, max_tokens=max_tokens)


def _finish_reason(completion, parsed_calls: bool) -> str:
    if completion.finish_reason == "length":
        return "length"
    return "tool_calls" if parsed_calls else "stop"


def _logprob(value: float) -> float:
    # A token the grammar masked has -inf, which JSON cannot carry: vLLM's floor.
    return max(value, -9999.0)


def _chat_logprobs(server: Server, completion, top: int | None) -> dict:
    content = []
    for i, token in enumerate(completion.token_ids):
        text = server.tokenizer.decode([token], skip_special_tokens=False)
        entry = {"token": text, "logprob": _logprob(completion.logprobs[i]), "bytes": list(text.encode()),
                 "top_logprobs": []}
        if top:
            entry["top_logprobs"] = [
                {"token": (t := server.tokenizer.decode([tid], skip_special_tokens=False)), "logprob": _logprob(lp),
                 "bytes": list(t.encode())} for tid, lp in completion.top_logprobs[i][:top]
            ]
        content.append(entry)
    return {"content": content}


def _usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        server.check_model(body.model)
        tools = None if body.tool_choice == "none" else [t.model_dump() for t in body.tools or []] or None
        messages = []
        for m in body.messages:
            message = m.model_dump(exclude_none=True)
            message["content"] = content_text(m.content)
            messages.append(message)
        prompt_ids = server.encode(render_prompt(messages, tools, body.reasoning_effort))
        max_tokens = server.limit_max_tokens(len(prompt_ids), body.max_tokens)
        grammar = _output_grammar(server, body, tools, max_tokens)
        top = body.top_logprobs if body.logprobs else None
        request_id = new_id("chatcmpl")
        params = [sampling_params(body, max_tokens, i, (top or 0) if body.logprobs else None, grammar)
                  for i in range(body.n)]
        streams = [server.generate(f"{request_id}-{i}", prompt_ids, p) for i, p in enumerate(params)]
        created = int(time.time())
        if body.stream:
            return streaming(_chat_events(server, body, request_id, created, streams, tools, len(prompt_ids), top))
        finals = await gather_outputs(streams)
        choices, completion_tokens = [], 0
        for i, out in enumerate(finals):
            parser = OutputStream(server.tokenizer, tools)
            parser.feed(dataclasses.replace(out, new_text=out.outputs[0].text))
            parsed = parser.parsed()
            completion = out.outputs[0]
            completion_tokens += len(completion.token_ids)
            message = {"role": "assistant", "content": parsed.content or (None if parsed.tool_calls else ""),
                       "reasoning_content": parsed.reasoning or None}
            if parsed.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments_json}}
                                         for c in parsed.tool_calls]
            choices.append({"index": i, "message": message,
                            "logprobs": _chat_logprobs(server, completion, top) if body.logprobs else None,
                            "finish_reason": _finish_reason(completion, bool(parsed.tool_calls))})
        return {"id": request_id, "object": "chat.completion", "created": created, "model": server.model_name,
                "choices": choices,
                "usage": _usage(len(prompt_ids), completion_tokens, finals[0].num_cached_tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        server.check_model(body.model)
        prompt_ids = server.encode(body.prompt) if isinstance(body.prompt, str) else server.check_ids(body.prompt)
        max_tokens = server.limit_max_tokens(len(prompt_ids), body.max_tokens if body.max_tokens is not None else 16)
        request_id = new_id("cmpl")
        params = [sampling_params(body, max_tokens, i, body.logprobs) for i in range(body.n)]
        streams = [server.generate(f"{request_id}-{i}", prompt_ids, p) for i, p in enumerate(params)]
        created = int(time.time())
        prefix = server.tokenizer.decode(prompt_ids, skip_special_tokens=False) if body.echo else ""
        if body.stream:
            return streaming(_completion_events(server, body, request_id, created, streams, prefix, len(prompt_ids)))
        finals = await gather_outputs(streams)
        choices = [{"index": i, "text": prefix + out.outputs[0].text,
                    "logprobs": _completion_logprobs(server, out.outputs[0], body.logprobs),
                    "finish_reason": out.outputs[0].finish_reason or "stop"} for i, out in enumerate(finals)]
        tokens = sum(len(out.outputs[0].token_ids) for out in finals)
        return {"id": request_id, "object": "text_completion", "created": created, "model": server.model_name,
                "choices": choices, "usage": _usage(len(prompt_ids), tokens, finals[0].num_cached_tokens)}


def _completion_logprobs(server: Server, completion, top: int | None) -> dict | None:
    if top is None:
        return None
    tokens = [server.tokenizer.decode([t], skip_special_tokens=False) for t in completion.token_ids]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top_logprobs = [{server.tokenizer.decode([tid], skip_special_tokens=False): _logprob(lp) for tid, lp in row[:top]}
                    for row in completion.top_logprobs] if top else None
    return {"tokens": tokens, "token_logprobs": [_logprob(lp) for lp in completion.logprobs], "text_offset": offsets,
            "top_logprobs": top_logprobs}


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of n concurrent generations as they come, tagged with their index. Closing this
    iterator (client gone) closes every stream, which aborts its request."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as error:  # noqa: BLE001 - surfaced to the response below
            await queue.put((i, error))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()


async def _error_event(error: Exception) -> str:
    api_error = error if isinstance(error, ApiError) else ApiError(500, str(error), "server_error")
    return sse(openai_error(api_error))


async def _chat_events(server: Server, body: ChatCompletionRequest, request_id: str, created: int, streams,
                       tools, prompt_tokens: int, top: int | None) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": server.model_name}
    chunk = lambda i, delta, finish=None, logprobs=None: sse(
        base | {"choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
    parsers = [OutputStream(server.tokenizer, tools) for _ in streams]
    has_calls = [False] * len(streams)
    completion_tokens, cached = 0, 0
    for i in range(len(streams)):
        yield chunk(i, {"role": "assistant", "content": ""})
    try:
        async for i, out in _merged(streams):
            completion = out.outputs[0]
            logprobs = None
            if body.logprobs and out.new_token_ids:
                n = len(out.new_token_ids)
                partial = type(completion)(token_ids=completion.token_ids[-n:], logprobs=completion.logprobs[-n:],
                                           top_logprobs=completion.top_logprobs[-n:])
                logprobs = _chat_logprobs(server, partial, top)
            for event in parsers[i].feed(out):
                if isinstance(event, ReasoningDelta):
                    yield chunk(i, {"reasoning_content": event.text})
                elif isinstance(event, ContentDelta):
                    yield chunk(i, {"content": event.text}, logprobs=logprobs)
                    logprobs = None
                elif isinstance(event, ToolCallStart):
                    has_calls[i] = True
                    yield chunk(i, {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                                    "function": {"name": event.name, "arguments": ""}}]})
                elif isinstance(event, ToolCallArgumentsDelta):
                    yield chunk(i, {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
            if logprobs is not None:
                yield chunk(i, {}, logprobs=logprobs)
            if out.finished:
                completion_tokens += len(completion.token_ids)
                cached = out.num_cached_tokens
                yield chunk(i, {}, finish=_finish_reason(completion, has_calls[i]))
    except Exception as error:  # noqa: BLE001 - the status line is sent; report in the stream
        yield await _error_event(error)
        return
    if body.stream_options and body.stream_options.include_usage:
        yield sse(base | {"choices": [], "usage": _usage(prompt_tokens, completion_tokens, cached)})
    yield sse("[DONE]")


async def _completion_events(server: Server, body: CompletionRequest, request_id: str, created: int, streams,
                             prefix: str, prompt_tokens: int) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "text_completion", "created": created, "model": server.model_name}
    completion_tokens = 0
    if prefix:
        for i in range(len(streams)):
            yield sse(base | {"choices": [{"index": i, "text": prefix, "logprobs": None, "finish_reason": None}]})
    try:
        async for i, out in _merged(streams):
            completion = out.outputs[0]
            if out.finished:
                completion_tokens += len(completion.token_ids)
            if out.new_text or out.finished:
                yield sse(base | {"choices": [{"index": i, "text": out.new_text, "logprobs": None,
                                               "finish_reason": completion.finish_reason if out.finished else None}]})
    except Exception as error:  # noqa: BLE001
        yield await _error_event(error)
        return
    if body.stream_options and body.stream_options.include_usage:
        yield sse(base | {"choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
    yield sse("[DONE]")

