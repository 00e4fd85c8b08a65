"""The shipped tokenizer (byte-level BPE, Beam's control tokens) and Beam's chat template."""

import importlib.util
import inspect
import json
import json.encoder
import random

import jinja2
import pytest

from beam_jax.tokenizer import (
    CHAT_TEMPLATE_PATH,
    PARAMETER_CLOSER_TOKEN,
    SPECIAL_TOKENS,
    TOKENIZER_DIR,
    VOCAB_SIZE,
    load_tokenizer,
    render_chat,
)

SYSTEM = (
    "<|start|>system<|message|>You are Beam, a large language model trained by Reflection.\n\n"
    "Reasoning: medium\n\n"
    "# Valid channels: analysis, final. Channel must be included for every message.<|end|>"
)
SYSTEM_WITH_TOOLS = SYSTEM.replace("<|end|>", "\nCalls to tools must go to the analysis channel.<|end|>")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
WEATHER_TOOL_JSON = (
    '{"name": "get_weather", "description": "Current weather.", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}'
)
# Arguments out of order (sorted in the output); `days` is not a string.
TOOL_CALL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Ask the tool.",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"days": 2, "city": "Paris"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
]
MULTI_TURN_CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "reasoning_content": "Easy: 4.", "content": "Four."},
    {"role": "user", "content": "3+3?"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def random_text(rng: random.Random, length: int) -> str:
    """Text drawn from ASCII, whitespace and controls, Latin, CJK, emoji and combining marks."""
    ranges = [(0x00, 0x7F), (0x80, 0x24F), (0x300, 0x36F), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF),
              (0x2000, 0x206F), (0xE000, 0xF8FF), (0x10000, 0x10FFFF)]
    chars = []
    for _ in range(length):
        low, high = rng.choice(ranges)
        chars.append(chr(rng.randint(low, high)))
    return "".join(chars)


# --- tokenizer ---------------------------------------------------------------------------------


def test_vocab_size_is_8192(tokenizer):
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE == 8192
    assert sorted(tokenizer.get_vocab(with_added_tokens=True).values()) == list(range(VOCAB_SIZE))


def test_special_tokens_have_fixed_single_ids(tokenizer):
    assert len(SPECIAL_TOKENS) in (16, 32) and len(set(SPECIAL_TOKENS)) == len(SPECIAL_TOKENS)
    assert SPECIAL_TOKENS[:8] == ("<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>",
                                  "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
    assert "<|mask|>" in SPECIAL_TOKENS
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id
        assert tokenizer.encode(token).ids == [token_id]
        assert tokenizer.encode(f"a{token}b").ids[1:-1] == [token_id]


def test_parameter_closer_is_one_ordinary_token(tokenizer):
    closer_id = tokenizer.encode(PARAMETER_CLOSER_TOKEN).ids
    assert closer_id == [VOCAB_SIZE - 1]
    assert tokenizer.decode(closer_id, skip_special_tokens=True) == PARAMETER_CLOSER_TOKEN


@pytest.mark.parametrize("token", SPECIAL_TOKENS)
def test_lookalike_text_never_encodes_to_a_special_token(tokenizer, token):
    name = token[2:-2]
    lookalikes = [f"<|{name} |>", f"< |{name}|>", f"<|{name.upper()}|>", f"<|{name}|", f"|{name}|>",
                  f"<{name}>", f"<|{name}||>", f"<\\|{name}\\|>", f"<|{name}\u200b|>", name]
    for text in lookalikes:
        ids = tokenizer.encode(text).ids
        assert not set(ids) & set(range(len(SPECIAL_TOKENS))), (text, ids)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_ordinary_text_uses_no_special_ids(tokenizer):
    rng = random.Random(1)
    texts = [inspect.getsource(json.encoder)] + [random_text(rng, 200) for _ in range(50)]
    for text in texts:
        assert min(tokenizer.encode(text).ids) >= len(SPECIAL_TOKENS)


def test_round_trip_random_unicode(tokenizer):
    rng = random.Random(0)
    for length in [0, 1, 2, 3, 7, 50, 500] * 20:
        text = random_text(rng, length)
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_round_trip_code_and_whitespace(tokenizer):
    texts = [
        inspect.getsource(json.encoder),
        " leading space",
        "  two\n\n\n\t\ttabs  \r\n trailing  ",
        "x = {'a': [1, 2.5e-3]}  # comment\n",
        "text with <|start|> and <|call|> tokens" + PARAMETER_CLOSER_TOKEN,
    ]
    for text in texts:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert len(tokenizer.encode(texts[0]).ids) < len(texts[0].encode()) / 3  # it learned merges


def test_rendered_prompt_uses_control_token_ids(tokenizer):
    ids = tokenizer.encode(render_chat(TOOL_CALL_CONVERSATION, tools=[WEATHER_TOOL])).ids
    start, message, end, call, constrain = (SPECIAL_TOKENS.index(t) for t in
                                            ("<|start|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>"))
    assert ids[0] == start and ids[-1] != end
    assert ids.count(message) == ids.count(start) - 1  # all but the generation prompt
    assert ids.count(call) == 1 and ids.count(constrain) == 1
    assert ids.count(VOCAB_SIZE - 1) == 2  # one parameter closer per argument


def test_config_embeds_the_template_file():
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE_PATH.read_text()
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_build_script_reproduces_the_shipped_tokenizer():
    spec = importlib.util.spec_from_file_location(
        "build_tokenizer", TOKENIZER_DIR.parents[2] / "tools" / "build_tokenizer.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    if not build.DEFAULT_CORPUS_DIR.is_dir():
        pytest.skip(f"corpus {build.DEFAULT_CORPUS_DIR} not on this machine")
    rebuilt = build.train_tokenizer(build.read_corpus(build.DEFAULT_CORPUS_DIR))
    assert rebuilt.to_str() + "\n" == (TOKENIZER_DIR / "tokenizer.json").read_text()


# --- chat template -----------------------------------------------------------------------------


def test_system_and_user_with_generation_prompt():
    rendered = render_chat([{"role": "user", "content": "Hi!"}])
    assert rendered == SYSTEM + "<|start|>user<|message|>Hi!<|end|><|start|>assistant"
    assert render_chat([{"role": "user", "content": "Hi!"}], add_generation_prompt=False) == (
        SYSTEM + "<|start|>user<|message|>Hi!<|end|>")


def test_multi_turn_keeps_reasoning_and_final():
    assert render_chat(MULTI_TURN_CONVERSATION) == (
        SYSTEM
        + "<|start|>developer<|message|># Instructions\n\nAnswer in one word.<|end|>"
        + "<|start|>user<|message|>2+2?<|end|>"
        + "<|start|>assistant<|channel|>analysis<|message|>Easy: 4.<|end|>"
        + "<|start|>assistant<|channel|>final<|message|>Four.<|end|>"
        + "<|start|>user<|message|>3+3?<|end|>"
        + "<|start|>assistant"
    )


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_field_aliases(field):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", field: "R", "content": "A"}]
    assert "<|start|>assistant<|channel|>analysis<|message|>R<|end|>" in render_chat(messages)


def test_tool_call_with_sorted_arguments_and_tool_result():
    assert render_chat(TOOL_CALL_CONVERSATION, tools=[WEATHER_TOOL]) == (
        SYSTEM_WITH_TOOLS
        + "<|start|>developer<|message|># Tools\n\n" + WEATHER_TOOL_JSON + "<|end|>"
        + "<|start|>user<|message|>Weather in Paris?<|end|>"
        + "<|start|>assistant<|channel|>analysis<|message|>Ask the tool.<|end|>"
        + "<|start|>assistant to=get_weather<|channel|>analysis <|constrain|>xml<|message|>"
        + '<rfl:parameter name="city">\nParis\n</rfl:parameter>\n'
        + '<rfl:parameter name="days">\n2\n</rfl:parameter><|call|>'
        + '<|start|>functions.get_weather to=assistant<|channel|>analysis<|message|>{"sky": "clear"}<|end|>'
        + "<|start|>assistant"
    )


def test_json_string_arguments_render_like_objects():
    as_string = json.loads(json.dumps(TOOL_CALL_CONVERSATION))
    as_string[1]["tool_calls"][0]["function"]["arguments"] = '{"days": 2, "city": "Paris"}'
    assert render_chat(as_string) == render_chat(TOOL_CALL_CONVERSATION)


def test_parallel_calls_close_with_end_then_call_and_results_match_by_position():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "a", "arguments": {"x": [1, "é"]}}},
            {"function": {"name": "b", "arguments": {}}},
        ]},
        {"role": "tool", "content": "ra"},
        {"role": "tool", "content": "rb"},
    ]
    assert render_chat(messages, add_generation_prompt=False) == (
        SYSTEM + "<|start|>user<|message|>q<|end|>"
        + "<|start|>assistant to=a<|channel|>analysis <|constrain|>xml<|message|>"
        + '<rfl:parameter name="x">\n[1, "é"]\n</rfl:parameter><|end|>'
        + "<|start|>assistant to=b<|channel|>analysis <|constrain|>xml<|message|><|call|>"
        + "<|start|>functions.a to=assistant<|channel|>analysis<|message|>ra<|end|>"
        + "<|start|>functions.b to=assistant<|channel|>analysis<|message|>rb<|end|>"
    )


def test_reasoning_effort_changes_only_the_reasoning_line():
    messages = [{"role": "user", "content": "Hi"}]
    high = render_chat(messages, reasoning_effort="high")
    low = render_chat(messages, reasoning_effort="low")
    assert render_chat(messages) == render_chat(messages, reasoning_effort="medium")
    assert high.count("\nReasoning: high\n") == 1 and low.count("\nReasoning: low\n") == 1
    assert high != low and high.replace("Reasoning: high", "Reasoning: low") == low
    with pytest.raises(jinja2.TemplateError, match="reasoning_effort"):
        render_chat(messages, reasoning_effort="max")


def test_unknown_role_raises():
    with pytest.raises(jinja2.TemplateError, match="Unknown message role: narrator"):
        render_chat([{"role": "user", "content": "Hi"}, {"role": "narrator", "content": "..."}])


def test_tool_result_without_a_call_raises():
    with pytest.raises(jinja2.TemplateError, match="does not answer a tool call"):
        render_chat([{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": "x", "content": "r"}])


# --- parity with transformers ------------------------------------------------------------------

PARITY_CASES = {
    "user": dict(messages=[{"role": "user", "content": "Hi!"}]),
    "multi_turn": dict(messages=MULTI_TURN_CONVERSATION, reasoning_effort="high"),
    "tool_call": dict(messages=TOOL_CALL_CONVERSATION, tools=[WEATHER_TOOL], reasoning_effort="low"),
    "no_prompt": dict(messages=MULTI_TURN_CONVERSATION[:3], add_generation_prompt=False),
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR, local_files_only=True)


@pytest.mark.reference
@pytest.mark.parametrize("case", PARITY_CASES)
def test_render_chat_matches_transformers(hf_tokenizer, case):
    kwargs = dict(PARITY_CASES[case])
    messages = kwargs.pop("messages")
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    assert render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs) == expected


@pytest.mark.reference
def test_transformers_tokenizer_matches_and_round_trips(hf_tokenizer, tokenizer):
    assert len(hf_tokenizer) == VOCAB_SIZE
    assert hf_tokenizer.eos_token == "<|return|>" and hf_tokenizer.pad_token_id == 0
    assert hf_tokenizer.mask_token_id == SPECIAL_TOKENS.index("<|mask|>")
    rng = random.Random(2)
    texts = [random_text(rng, 300) for _ in range(20)] + [" a  b .\n", inspect.getsource(json.encoder)]
    for text in texts:
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        assert ids == tokenizer.encode(text).ids
        assert hf_tokenizer.decode(ids) == text
