"""Grammar-constrained decoding (serving/grammar.py with xgrammar): packed masks, the mask inside the
compiled sampling step, grammars in Beam's chat format walked token by token at random (every output
must parse and validate, whatever the choices), and the engine on random-weight beam-tiny, which
never writes JSON unless constrained."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import beam_jax
from beam_jax.tokenizer import load_tokenizer
from serving.api.chat_output import CHAT_FORMAT
from serving.chat.parser import parse
from serving.engine import EngineConfig, LLMEngine
from serving.grammar import ChatGrammars, GrammarBackend
from serving.sampling import SamplingBatch, SamplingParams, full_bitmask, pack_bitmask, sample, unpack_bitmask

VOCAB = 8192
RETURN, CALL = 5, 6  # <|return|>, <|call|>
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "hourly": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "required": ["key"],
        "properties": {"key": {"type": "string", "minLength": 2, "maxLength": 8},
                       "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                       "limit": {"type": ["integer", "null"], "minimum": 0, "maximum": 99},
                       "flags": {"type": "array", "items": {"$ref": "#/$defs/flag"}, "maxItems": 2}},
        "$defs": {"flag": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
                           "additionalProperties": False}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, VOCAB, [RETURN, CALL])


@pytest.fixture(scope="module")
def chat(backend):
    return ChatGrammars(CHAT_FORMAT, backend.special_tokens)


def allowed_ids(bitmask_row: np.ndarray) -> np.ndarray:
    return np.unpackbits(bitmask_row.view(np.uint8), bitorder="little").nonzero()[0]


def walk(backend, grammar, rng, *, prefix=(), limit=400) -> list[int]:
    """Tokens drawn uniformly from what the grammar allows, until it ends (a stop token) or `limit`."""
    matcher = backend.matcher(grammar)
    out = list(prefix)
    for token in prefix:
        assert matcher.accept(token)
    mask = full_bitmask(1, VOCAB)
    while len(out) < limit and not matcher.terminated:
        matcher.fill(mask, 0)
        token = int(rng.choice(allowed_ids(mask[0])))
        assert matcher.accept(token), "the mask allowed a token the grammar refuses"
        out.append(token)
        if token in (RETURN, CALL):
            break
    return out


# ---- masks ----------------------------------------------------------------------------------------
def test_pack_unpack_roundtrip():
    rng = np.random.default_rng(0)
    allowed = rng.random((3, 100)) < 0.3
    packed = pack_bitmask(allowed)
    assert packed.dtype == np.int32 and packed.shape == (3, 4)
    assert np.array_equal(np.asarray(unpack_bitmask(jnp.asarray(packed), 100)), allowed)
    assert np.array_equal(np.asarray(unpack_bitmask(jnp.asarray(full_bitmask(2, 70)), 70)), np.ones((2, 70), bool))


def test_packing_matches_xgrammar_layout(backend, chat):
    matcher = backend.matcher(chat.json_output(WEATHER))
    mask = full_bitmask(2, VOCAB)
    matcher.fill(mask, 1)
    allowed = np.zeros((1, VOCAB), bool)
    allowed[0, allowed_ids(mask[1])] = True
    assert 0 < allowed.sum() < VOCAB
    assert np.array_equal(pack_bitmask(allowed)[0], mask[1])
    assert (mask[0] == -1).all()  # other rows untouched


def test_sample_applies_the_mask():
    rng = np.random.default_rng(1)
    vocab, rows = 300, 4
    logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 3, jnp.float32)
    allowed = rng.random((rows, vocab)) < 0.05
    allowed[3] = True  # an unconstrained row
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.7, top_p=0.9, seed=4), SamplingParams(temperature=0)]

    def build(bitmask):
        return SamplingBatch.build(params, request_ids=range(rows), num_output_tokens=[0] * rows, vocab_size=vocab,
                                   token_bitmask=bitmask, num_top_logprobs=5)

    out = jax.jit(sample)(logits, build(pack_bitmask(allowed)))
    free = jax.jit(sample)(logits, build(None))
    tokens = np.asarray(out.tokens)
    assert all(allowed[i, tokens[i]] for i in range(rows))
    masked = np.where(allowed, np.asarray(logits), -np.inf)
    assert tokens[0] == masked[0].argmax()
    assert tokens[3] == np.asarray(free.tokens)[3] and out.logprobs[3] == free.logprobs[3]
    # logprobs are of the constrained distribution: the allowed tokens carry all the mass
    top = np.asarray(out.top_token_ids)
    assert all(allowed[i, top[i][np.isfinite(np.asarray(out.top_logprobs)[i])]].all() for i in range(rows))


# ---- grammars, walked at random -------------------------------------------------------------------
def test_json_schema_outputs_validate(backend, chat, tokenizer):
    rng = np.random.default_rng(2)
    raw = ChatGrammars(None).json_output(WEATHER)  # no chat format: bare JSON, ended by any stop token
    for _ in range(20):
        out = walk(backend, raw, rng)
        assert out[-1] in (RETURN, CALL)
        jsonschema.validate(json.loads(tokenizer.decode(out[:-1])), WEATHER)
    in_chat = chat.json_output(WEATHER, reasoning_tokens=8)
    for _ in range(20):
        out = walk(backend, in_chat, rng)
        assert out[-1] == RETURN  # the answer's stop token, never <|call|>
        parsed = parse(tokenizer.decode(out, skip_special_tokens=False), CHAT_FORMAT)
        jsonschema.validate(json.loads(parsed.content), WEATHER)
    any_object = chat.json_output(None)
    texts = [tokenizer.decode(walk(backend, any_object, rng, limit=60), skip_special_tokens=False) for _ in range(20)]
    assert all(t.startswith("<|channel|>final<|message|>{") for t in texts)
    finished = [parse(t, CHAT_FORMAT).content for t in texts if t.endswith("<|return|>")]
    assert finished and all(isinstance(json.loads(content), dict) for content in finished)


@pytest.mark.parametrize("name", [None, "get_weather", "lookup", "ping"])
def test_forced_tool_calls_parse_and_validate(backend, chat, tokenizer, name):
    rng = np.random.default_rng(3)
    grammar = chat.forced_tool_calls(TOOLS, name=name, reasoning_tokens=6)
    for _ in range(12):
        out = walk(backend, grammar, rng, limit=3000)  # `required` may chain parallel calls
        assert out[-1] == CALL
        calls = parse(tokenizer.decode(out, skip_special_tokens=False), CHAT_FORMAT, tools=TOOLS).tool_calls
        assert calls and (name is None or (len(calls) == 1 and calls[0].name == name))
        for call in calls:
            jsonschema.validate(json.loads(call.arguments_json), SCHEMAS[call.name])


def test_forced_call_never_ends_with_the_answer_stop(backend, chat, tokenizer):
    matcher = backend.matcher(chat.forced_tool_calls(TOOLS, name="ping"))
    for token in tokenizer.encode(" to=ping<|channel|>analysis <|constrain|>xml<|message|>").ids:
        assert matcher.accept(token)
    mask = full_bitmask(1, VOCAB)
    matcher.fill(mask, 0)
    assert allowed_ids(mask[0]).tolist() == [CALL]


def test_auto_calls_are_constrained_once_started(backend, chat, tokenizer):
    grammar = chat.tool_calls_once_started(TOOLS)
    matcher = backend.matcher(grammar)
    mask = full_bitmask(1, VOCAB)
    matcher.fill(mask, 0)
    assert (mask == -1).all()  # free output before a call
    rng = np.random.default_rng(4)
    prefix = tokenizer.encode("<|channel|>analysis<|message|>Let me check.<|end|><|start|>assistant to=").ids
    for _ in range(12):
        out = walk(backend, grammar, rng, prefix=prefix)
        text = tokenizer.decode(out, skip_special_tokens=False)
        calls = parse(text, CHAT_FORMAT, tools=TOOLS).tool_calls
        assert len(calls) == 1 and calls[0].name in SCHEMAS, text
        jsonschema.validate(calls[0].arguments, SCHEMAS[calls[0].name])


def test_bad_schema_is_a_value_error(backend, chat):
    with pytest.raises(ValueError):
        backend.compile(chat.json_output({"type": "object", "properties": {"a": {"type": "no-such-type"}}}))
    with pytest.raises(ValueError):
        chat.forced_tool_calls(TOOLS, name="missing")


# ---- the engine -----------------------------------------------------------------------------------
def test_engine_constrained_json_and_no_recompilation():
    beam = beam_jax.load("beam-tiny", dtype=jnp.float32, seed=2)
    engine = LLMEngine(beam, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=192))
    engine.warmup()
    warm = engine.runner.compilations
    grammar = ChatGrammars(None).json_output(WEATHER)
    requests = {
        "greedy": SamplingParams(temperature=0, max_tokens=80, grammar=grammar),
        "free": SamplingParams(temperature=0, max_tokens=30),
        "seed1": SamplingParams(temperature=1.0, seed=1, max_tokens=80, grammar=grammar),
        "seed2": SamplingParams(temperature=0.8, top_k=50, seed=2, max_tokens=80, min_tokens=4, grammar=grammar),
    }
    for request_id, params in requests.items():
        engine.add_request(request_id, f"The weather, {request_id}:", params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    for request_id in ("greedy", "seed1", "seed2"):
        completion = done[request_id]
        assert completion.finish_reason == "stop" and completion.token_ids[-1] in engine.eos_token_ids
        jsonschema.validate(json.loads(completion.text), WEATHER)
    with pytest.raises(ValueError):
        json.loads(done["free"].text)  # random weights never write JSON unconstrained
    assert engine.runner.compilations == warm
