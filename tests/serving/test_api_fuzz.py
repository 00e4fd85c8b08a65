"""Property-based fuzzing of the HTTP API against a real uvicorn server on fp32 `beam-tiny`.

Two generators, both through hypothesis:
- schemathesis, from the server's own OpenAPI schema: bodies that follow the schema (positive) and
  bodies that break it (negative: wrong types, missing fields, out-of-range numbers, ...);
- mutations of known-good requests of each API: one to three places in the body (at any depth:
  content parts, tool calls, tool schemas, blocks, ...) replaced by arbitrary JSON, lone surrogates
  and NaN included, or removed. The schema types content parts and blocks only as objects, so this
  is what reaches the code that reads them.

Every response must be:
- never a 5xx;
- an error body shaped as its API shapes errors (OpenAI `{"error": {"message", "type", ...}}`,
  Anthropic `{"type": "error", "error": {"type", "message"}}`) whenever the status is 4xx;
- a 4xx whenever schemathesis meant the body to break the schema;
- for a stream, free of `server_error` / `api_error` events (a 5xx after the status line);
- strict JSON: no NaN or Infinity (what `json.dumps` writes for a -inf logprob).

Positive schemathesis cases name the served model (a random name would stop every one of them at
the model check). Generation on CPU is slow, so within the range the server accepts, `max_tokens`
and `n` are clamped to small values (4 tokens, 2 choices); values outside that range are sent as
generated, so the "too many tokens" and "n out of range" paths are fuzzed too.

`test_api_fuzz` sends ~200 requests (about a minute on 2 cores, after the server's warm-up);
`test_api_fuzz_long` (slow: `--run-slow`) 10x as many. FUZZ_DEBUG=1 prints every 4xx body.
"""

from __future__ import annotations

import copy
import json
import os
import time

import httpx
import pytest
import requests  # a schemathesis dependency
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.parameters import ParameterLocation

from serving.engine import EngineConfig
from tests.serving.live_server import live_server, pool_is_free


KEY = "fuzz-key"
MODEL = "beam-tiny"
MAX_MODEL_LEN = 256
MAX_TOKENS = 4  # clamp for max_tokens the server would accept
MAX_N = 2  # clamp for n the server would accept
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN)
    with live_server(config, seed=3, model=MODEL, api_key=KEY) as running:
        yield running


def _clamp(body, path: str):
    """Small generations for bodies the server would accept; everything else as generated."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and 1 <= value <= MAX_MODEL_LEN:
            body[key] = min(value, MAX_TOKENS)
    n = body.get("n")
    if type(n) is int and 1 <= n <= 16:
        body["n"] = min(n, MAX_N)
    # Without max_tokens a chat request may generate up to the context: give it the clamp too.
    if path == "/v1/chat/completions" and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    return body


def _is_openai_error(body) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


def _is_anthropic_error(body) -> bool:
    return (isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict)
            and isinstance(body["error"].get("type"), str) and isinstance(body["error"].get("message"), str))


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON (Python's json writes it, strict parsers reject it)")


def _check(path: str, body, status: int, content_type: str, text: str, *, meant_invalid: bool = False) -> None:
    where = f"POST {path} body={body!r}"[:2000]
    assert status < 500, f"{status} for {where}: {text[:500]}"
    if status >= 400:
        try:
            error = json.loads(text, parse_constant=_not_json)
        except ValueError:
            pytest.fail(f"{status} without a JSON body for {where}: {text[:500]}")
        shaped = _is_anthropic_error(error) if path.startswith("/v1/messages") else _is_openai_error(error)
        assert shaped, f"{status} body not shaped as the API's errors for {where}: {error}"
        return
    assert not meant_invalid, f"a body that breaks the schema was accepted ({status}) for {where}"
    if content_type.startswith("text/event-stream"):
        for line in text.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:], parse_constant=_not_json)
            if _is_openai_error(payload):
                assert payload["error"]["type"] != "server_error", f"server error in the stream of {where}: {payload}"
            if _is_anthropic_error(payload):
                assert payload["error"]["type"] != "api_error", f"server error in the stream of {where}: {payload}"


class Tally:
    """Responses by (route, generator, status), printed at the end of a run."""

    def __init__(self):
        self.counts: dict[tuple[str, str, int], int] = {}
        self.seconds = 0.0
        self.slowest: list[tuple[float, str]] = []

    def add(self, path: str, kind: str, status: int, text: str, seconds: float = 0.0, body=None) -> None:
        self.seconds += seconds
        self.slowest = sorted([*self.slowest, (seconds, f"{status} {path} {json.dumps(body, default=repr)[:300]}")])[-5:]
        key = (path, kind, status)
        self.counts[key] = self.counts.get(key, 0) + 1
        if status >= 400 and os.environ.get("FUZZ_DEBUG"):
            print(key, text[:300])

    def total(self) -> int:
        return sum(self.counts.values())

    def report(self) -> str:
        lines = [f"{n:4d}  {path} {kind} {status}" for (path, kind, status), n in sorted(self.counts.items())]
        lines += [f"{self.total()} requests, {self.seconds:.1f} s waiting for responses; the slowest:"]
        return "\n".join(lines + [f"{seconds:6.2f} s  {what}" for seconds, what in reversed(self.slowest)])


def _schemathesis(base: str, tally: Tally, examples_per_operation: int) -> None:
    schema = schemathesis.openapi.from_dict(httpx.get(f"{base}/openapi.json", headers=HEADERS).json())
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            posts = operation.method.upper() == "POST"
            for mode in [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if posts else [GenerationMode.POSITIVE]:
                _operation_test(base, session, tally, operation, mode, examples_per_operation if posts else 2)()


def _operation_test(base: str, session, tally: Tally, operation, mode: GenerationMode, examples: int):
    posts = operation.method.upper() == "POST"

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        if posts and isinstance(case.body, dict):
            body = _clamp(case.body, case.path)
            if mode is GenerationMode.POSITIVE and isinstance(body.get("model"), str):
                body["model"] = MODEL  # past the model check, into rendering and generation
            case.body = body
        started = time.monotonic()
        response = case.call(base_url=base, session=session, headers=HEADERS, timeout=120)
        tally.add(case.path, f"schemathesis-{mode.value}", response.status_code, response.text,
                  time.monotonic() - started, case.body if posts else None)
        content_type = response.headers.get("content-type") or [""]  # header -> list of values
        meant_invalid = case.meta is not None and case.meta.is_negative_at(ParameterLocation.BODY)
        _check(case.path, case.body if posts else None, response.status_code,
               content_type[0] if isinstance(content_type, list) else content_type, response.text,
               meant_invalid=meant_invalid)

    return run


# Known-good requests that use every part of each API (keyed by route, then a tag); the mutations
# start from these.
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
VALID = {
    "/v1/chat/completions": {
        "model": MODEL, "max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 1, "stop": ["\n\n"],
        "logprobs": True, "top_logprobs": 2, "n": 1, "stream_options": {"include_usage": True},
        "reasoning_effort": "low", "response_format": {"type": "text"}, "tools": [TOOL], "tool_choice": "auto",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "Call the tool.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    },
    "/v1/chat/completions json_schema": {
        "model": MODEL, "max_tokens": 4, "logprobs": True, "top_logprobs": 20, "seed": 2, "temperature": 1.0,
        "messages": [{"role": "user", "content": "A city as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
            "type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
            "required": ["name"]}}},
    },
    "/v1/completions": {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 2, "temperature": 0.5, "top_k": 5,
                        "seed": 3, "stop": ["\n"], "logprobs": 2, "echo": True, "n": 1,
                        "presence_penalty": 0.5, "frequency_penalty": 0.1, "repetition_penalty": 1.1},
    "/v1/messages": {
        "model": MODEL, "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 10, "stop_sequences": ["END"],
        "system": [{"type": "text", "text": "Be brief."}], "thinking": {"type": "enabled", "budget_tokens": 16},
        "metadata": {"user_id": "u1"}, "tool_choice": {"type": "auto"},
        "tools": [{"name": "get_weather", "description": "Weather of a city.",
                   "input_schema": TOOL["function"]["parameters"]}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call the tool.", "signature": ""},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}]},
        ],
    },
}

# Any JSON value, with what breaks naive code: lone surrogates, NaN and infinities, huge integers.
_SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63 - 2, max_value=2**70)
            | st.floats() | st.text(st.characters(exclude_categories=()), max_size=8)
            | st.sampled_from(["", "text", "function", "tool_use", "tool_result", "thinking", "object", MODEL]))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def _places(value, path=()):
    """Every (path to a value) in a JSON tree."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _places(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _places(item, (*path, index))


# A value of another kind than the one it replaces (type confusion), or any JSON value.
_OTHER_KIND = {str: st.none() | st.integers() | st.floats() | st.lists(st.text(max_size=3), max_size=2) | st.just({}),
               bool: st.integers(2, 3) | st.text(max_size=3), int: st.floats() | st.text(max_size=3) | st.none(),
               float: st.text(max_size=3) | st.none() | st.booleans(), dict: st.lists(_SCALARS, max_size=2) | st.text(),
               list: st.dictionaries(st.text(max_size=3), _SCALARS, max_size=2) | st.text() | st.none()}


@st.composite
def _mutated(draw):
    """A known-good request with one to three places changed: removed, given a value of another
    kind, or any JSON. Mostly one place, so the rest of the body stays valid and the request gets
    as far as the changed value lets it."""
    name = draw(st.sampled_from(sorted(VALID)))
    route, body = name.split()[0], copy.deepcopy(VALID[name])
    body["stream"] = draw(st.booleans())
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        path = draw(st.sampled_from([p for p in _places(body) if p]))
        parent = body
        for step in path[:-1]:
            parent = parent[step]
        old = parent[path[-1]]
        action = draw(st.sampled_from(["other kind", "other kind", "any", "remove"]))
        if action == "remove":
            del parent[path[-1]]
        elif action == "other kind" and type(old) in _OTHER_KIND:
            parent[path[-1]] = draw(_OTHER_KIND[type(old)])
        else:
            parent[path[-1]] = draw(_JSON)
    return route, _clamp(body, route)


def _mutations(base: str, tally: Tally, examples: int) -> None:
    with httpx.Client(base_url=base, headers=HEADERS, timeout=120) as client:
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(request=_mutated())
        def run(request):
            route, body = request
            # Python's json writes NaN and Infinity, as some clients do; lone surrogates go out escaped.
            started = time.monotonic()
            response = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
            tally.add(route, "mutation", response.status_code, response.text, time.monotonic() - started, body)
            _check(route, body, response.status_code, response.headers.get("content-type", ""), response.text)

        run()


def _still_serves(base: str) -> None:
    ok = httpx.post(f"{base}/v1/chat/completions", headers=HEADERS, timeout=60,
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def _run(server, schemathesis_examples: int, mutation_examples: int) -> None:
    base, async_engine = server
    tally = Tally()
    try:
        _schemathesis(base, tally, schemathesis_examples)
        _mutations(base, tally, mutation_examples)
    finally:
        print(tally.report())
    assert tally.total() >= 6 * schemathesis_examples + mutation_examples
    _still_serves(base)
    assert pool_is_free(async_engine)


def test_api_fuzz(server):
    _run(server, schemathesis_examples=18, mutation_examples=90)


@pytest.mark.slow
def test_api_fuzz_long(server):
    _run(server, schemathesis_examples=180, mutation_examples=900)


def test_mutation_places_reach_nested_fields():
    places = set(_places(VALID["/v1/messages"]))
    assert ("messages", 2, "content", 0, "content", 0, "text") in places
