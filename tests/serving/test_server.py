"""The server, started for real (uvicorn on 127.0.0.1) on fp32 beam-tiny, driven by the official
`openai` and `anthropic` SDKs and by raw HTTP for bad input."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from serving.engine import EngineConfig
from tests.serving.live_server import live_server, pool_is_free


KEY = "test-key"
MODEL = "beam-tiny"


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512)
    with live_server(config, seed=2, model=MODEL, api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY)


MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0
    content, reasoning, finish, usage = "", "", None, None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            finish = c.finish_reason or finish
    assert content == (choice.message.content or "")
    assert reasoning == (getattr(choice.message, "reasoning_content", None) or "")
    assert finish == choice.finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


def test_chat_n_seed_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=7, n=2, max_tokens=8,
                                         logprobs=True, top_logprobs=2)
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=7, n=2, max_tokens=8,
                                           logprobs=True, top_logprobs=2)
    assert len(out.choices) == 2
    assert [c.logprobs.content[0].logprob for c in out.choices] == [c.logprobs.content[0].logprob for c in again.choices]
    assert all(len(entry.top_logprobs) == 2 for c in out.choices for entry in c.logprobs.content)


def test_completions_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt="import os\n", temperature=0, max_tokens=20)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="import os\n", temperature=0, max_tokens=20, stream=True))
    assert streamed == full.choices[0].text and full.usage.completion_tokens == 20 or full.choices[0].finish_reason == "stop"
    assert client.models.list().data[0].id == MODEL


def test_anthropic_messages_and_stream(server):
    client = anthropic.Anthropic(base_url=server[0], api_key=KEY)
    # (this SDK version has no `temperature` argument; the API field goes in the body)
    message = client.messages.create(model=MODEL, max_tokens=24, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": "def fib(n):"}], system="You write Python.")
    assert message.role == "assistant" and message.stop_reason in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    text = "".join(b.text for b in message.content if b.type == "text")
    with client.messages.stream(model=MODEL, max_tokens=24, extra_body={"temperature": 0}, system="You write Python.",
                                messages=[{"role": "user", "content": "def fib(n):"}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.usage.output_tokens == message.usage.output_tokens


BAD = [
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/chat/completions", {"model": "gpt-4", "messages": MESSAGES}, 404),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": "many"}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": -3}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 10**9}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * 2000}]}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": [1, 10**7]}, 400),
    ("POST", "/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, 400),  # no max_tokens
    ("GET", "/v1/nothing-here", None, 404),
]


def test_bad_input_gets_4xx_and_server_keeps_serving(server, client):
    base, _ = server
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=base, timeout=30) as http:
        for method, path, body, status in BAD:
            content = body if isinstance(body, bytes) else (json.dumps(body) if body is not None else None)
            response = http.request(method, path, content=content, headers=headers)
            assert response.status_code == status, (path, body, response.text)
            error = response.json()
            if path == "/v1/messages":
                assert error["type"] == "error" and error["error"]["message"]
            else:
                assert error["error"]["message"] and error["error"]["type"]
        wrong_key = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES},
                              headers={"Authorization": "Bearer nope"})
        assert wrong_key.status_code == 401 and wrong_key.json()["error"]["type"] == "authentication_error"
        assert http.get("/health").status_code == 200  # no key needed
        metrics = http.get("/metrics", headers=headers).text
        assert "beam_time_to_first_token_seconds_count" in metrics and "beam_kv_pool_usage" in metrics
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert ok.choices[0].message is not None


def test_many_concurrent_streams_and_disconnects_free_the_pool(server):
    base, async_engine = server

    async def stream(http, i):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 12,
                "stream": True, "temperature": 0.5, "seed": i}
        events = 0
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    assert not line.startswith('data: {"error"')
        return events

    async def disconnect(http, i):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"long {i}"}], "max_tokens": 400,
                "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    break  # leave mid-stream: the connection closes

    async def main():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=base, timeout=300, headers=headers,
                                     limits=httpx.Limits(max_connections=100)) as http:
            results = await asyncio.gather(*(stream(http, i) for i in range(64)),
                                           *(disconnect(http, i) for i in range(16)))
        return results[:64]

    counts = asyncio.run(main())
    assert all(n >= 3 for n in counts)  # role chunk, at least one more, [DONE]
    # The server notices the disconnects and aborts those requests.
    assert pool_is_free(async_engine)


# ---- grammar-constrained output (random weights never write JSON or a call unless constrained) ------
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.mark.parametrize("seed", [None, 1])
def test_response_format_json_schema_validates(client, seed):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=160, temperature=0 if seed is None else 1.0, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_tool_choice_required_and_named_give_valid_calls(client):
    # (one call: random weights would chain parallel calls up to max_tokens)
    for tool_choice, name in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                             parallel_tool_calls=False, temperature=0, max_tokens=200)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        call = choice.message.tool_calls[0]
        assert name is None or call.function.name == name
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        streamed = {}
        for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                                    parallel_tool_calls=False, temperature=0, max_tokens=200,
                                                    stream=True):
            for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
                entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
        assert streamed[0] == {"name": call.function.name, "arguments": call.function.arguments}


def test_anthropic_tool_choice_any_and_tool(server):
    client = anthropic.Anthropic(base_url=server[0], api_key=KEY)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for tool_choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}):
        message = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=tools, tool_choice=tool_choice,
                                         extra_body={"temperature": 0})
        assert message.stop_reason == "tool_use"
        use = next(b for b in message.content if b.type == "tool_use")
        assert tool_choice["type"] == "any" or use.name == "get_weather"
        jsonschema.validate(use.input, SCHEMAS[use.name])


def test_bad_grammar_requests_get_400(server):
    base, _ = server
    bad = [
        {"model": MODEL, "messages": ASK, "response_format": {"type": "json_schema", "json_schema": "x"}},
        {"model": MODEL, "messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
        {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    ]
    with httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as http:
        for body in bad:
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 400, (body, response.text)
        response = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": ASK,
                                                   "tool_choice": {"type": "any"}})
        assert response.status_code == 400 and response.json()["type"] == "error"


def test_http_sampling_limits_are_sampling_params_limits():
    """The request models use SamplingParams' float32 limits (no server needed): a repetition penalty
    outside them is a validation error (a 400), a tiny top_p is raised to MIN_TOP_P by SamplingParams."""
    from pydantic import ValidationError

    from serving.api.openai_api import sampling_params
    from serving.api.protocol import ChatCompletionRequest
    from serving.sampling import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, MIN_TOP_P

    for penalty in (MIN_REPETITION_PENALTY / 2, MAX_REPETITION_PENALTY * 2):
        with pytest.raises(ValidationError, match="repetition_penalty"):
            ChatCompletionRequest(model=MODEL, messages=MESSAGES, repetition_penalty=penalty)
    body = ChatCompletionRequest(model=MODEL, messages=MESSAGES, top_p=1e-40, repetition_penalty=MIN_REPETITION_PENALTY)
    params = sampling_params(body, max_tokens=4, seed_offset=0, logprobs=None)
    assert params.top_p == MIN_TOP_P and params.repetition_penalty == MIN_REPETITION_PENALTY
