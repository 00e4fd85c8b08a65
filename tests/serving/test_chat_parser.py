"""The chat output parser compiled from chat templates: Beam's shipped template, a Qwen3-like one and a
Qwen3-Coder-like one written here, learned by the same probe and parsed by the same code.

Beam's expected values were checked against SGLang's Beam parser (`srt/parser/beam.py`, run by its
`ResponseParser`, with its `_closer_rest` and cut-off-call rules), including schema casts.
"""

import json
import random

import pytest

from beam_jax.tokenizer import STOP_TOKENS, render_chat
from serving.chat import (
    ChatFormat,
    ContentDelta,
    JsonCallFormat,
    Marker,
    ParameterFormat,
    ReasoningDelta,
    StreamingParser,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallFormat,
    ToolCallStart,
    beam_chat_format,
    collect,
    learn_chat_format,
    parse,
)
from serving.chat.parser import coerce_argument, schema_types

QWEN_LIKE_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n# Tools\n\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
    {{- '\n</tools>\n\nReturn each call as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call>' }}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role in ["user", "system"] %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content if message.content is string else '' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if loop.last or reasoning %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if (loop.first and content) or not loop.first %}{{- '\n' }}{%- endif %}
            {%- set tool_call = tool_call.function if tool_call.function else tool_call %}
            {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
QWEN_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")

# Qwen3-Coder-like: XML tool calls, `<function=NAME>` and `<parameter=KEY>` tags, no reasoning.
CODER_LIKE_TEMPLATE = r"""
{%- for message in messages %}
    {%- if message.role == "user" %}{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\n' + (message.content or '') }}
        {%- for tool_call in message.tool_calls or [] %}
            {{- '\n<tool_call>\n<function=' + tool_call.function.name + '>\n' }}
            {%- for key, value in tool_call.function.arguments.items() %}
                {{- '<parameter=' + key + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' }}
            {%- endfor %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                           "units": {"type": ["string", "null"]}, "options": {"type": "object"}},
        },
    },
}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "number"}}}}}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]


@pytest.fixture(scope="module")
def beam() -> ChatFormat:
    return beam_chat_format()


@pytest.fixture(scope="module")
def qwen() -> ChatFormat:
    return learn_chat_format(QWEN_LIKE_TEMPLATE, stop_tokens=QWEN_STOP_TOKENS)


def beam_call(name: str, arguments: dict[str, str]) -> str:
    parameters = "\n".join(f'<rfl:parameter name="{key}">\n{value}\n</rfl:parameter>'
                           for key, value in arguments.items())
    return f" to={name}<|channel|>analysis <|constrain|>xml<|message|>{parameters}"


def qwen_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def summary(parsed):
    return parsed.reasoning, parsed.content, [(call.name, call.arguments) for call in parsed.tool_calls]


def feed_in_pieces(chat_format, text, sizes, **kwargs):
    parser = StreamingParser(chat_format, call_id=lambda index: f"call_{index}", **kwargs)
    events, position = [], 0
    for size in sizes:
        events += parser.feed(text[position: position + size])
        position += size
    events += parser.feed(text[position:])
    return events + parser.finish()


def merged(events):
    """Events with adjacent deltas of one kind joined: what any chunking must agree on."""
    out = []
    for event in events:
        if out and type(out[-1]) is type(event) and hasattr(event, "text") \
                and getattr(out[-1], "index", None) == getattr(event, "index", None):
            out[-1] = type(event)(**{**out[-1].__dict__, "text": out[-1].text + event.text})
        else:
            out.append(event)
    return out


# --- what the probe learns --------------------------------------------------------------------------


def test_beam_format_learned_from_the_shipped_template(beam):
    # The same markers as SGLang's BEAM_RESPONSE_TEMPLATE, learned instead of written down.
    assert beam == ChatFormat(
        message_start="<|start|>assistant",
        reasoning_key="reasoning_content",
        reasoning_open=Marker("<|channel|>analysis<|message|>"),
        reasoning_close=(Marker("<|end|><|start|>assistant"),),
        content_open=Marker("<|channel|>final<|message|>"),
        content_close=(Marker("<|end|>"),),
        tool_call=ToolCallFormat(
            open=Marker(" to="),
            close=(Marker("<|call|>"), Marker("<|end|><|start|>assistant")),
            name_end="<|channel|>analysis <|constrain|>xml<|message|>",
            parameters=ParameterFormat('<rfl:parameter name="', '">\n', "\n</rfl:parameter>", "\n", json_values=False),
        ),
        stop_tokens=STOP_TOKENS,
    )


def test_qwen_like_format_learned(qwen):
    assert qwen == ChatFormat(
        message_start="<|im_start|>assistant\n",
        reasoning_key="reasoning_content",
        reasoning_open=Marker("<think>", trailing_newlines=1),
        reasoning_close=(Marker("</think>", leading_newlines=1, trailing_newlines=2),),
        content_open=None,  # the answer is whatever is outside the other parts
        content_close=(Marker("<|im_end|>", trailing_newlines=1),),
        tool_call=ToolCallFormat(
            open=Marker("<tool_call>", leading_newlines=1, trailing_newlines=1),
            close=(Marker("</tool_call>", leading_newlines=1, trailing_newlines=1),),
            json=JsonCallFormat("name", "arguments", arguments_as_string=False),
        ),
        stop_tokens=QWEN_STOP_TOKENS,
    )


def test_coder_like_format_learned_and_parsed():
    coder = learn_chat_format(CODER_LIKE_TEMPLATE, stop_tokens=("<|im_end|>",))
    assert coder.reasoning_open is None and coder.content_open is None
    assert coder.tool_call.name_end == ">" and coder.tool_call.parameters.name_end == ">\n"
    text = ("Let me look.\n<tool_call>\n<function=search>\n<parameter=query>\nx < y\n</parameter>\n"
            "<parameter=limit>\n2.5\n</parameter>\n</function>\n</tool_call><|im_end|>")
    assert summary(parse(text, coder, tools=TOOLS)) == (
        "", "Let me look.", [("search", {"query": "x < y", "limit": 2.5})])


def test_template_without_tool_calls_learns_no_tool_format():
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|eot|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    chat_format = learn_chat_format(template)
    assert chat_format.tool_call is None and chat_format.reasoning_open is None
    assert chat_format.message_start == "<|assistant|>" and chat_format.content_close == (Marker("<|eot|>"),)
    assert summary(parse("Hi <|eot", chat_format)) == ("", "Hi <|eot", [])


def test_template_whose_turns_do_not_start_with_the_generation_prompt_is_refused():
    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}[bot]{% endif %}")
    with pytest.raises(ValueError, match="generation prompt"):
        learn_chat_format(template)


# --- Beam: the split SGLang's Beam parser makes ---------------------------------------------------------

SPEC_CALL = (
    "<|channel|>analysis<|message|>Ask the tool.<|end|><|start|>assistant"
    + beam_call("get_weather", {"city": "Paris", "days": "2"}) + "<|call|>"
)


def test_beam_reasoning_then_tool_call(beam):
    assert summary(parse(SPEC_CALL, beam, tools=TOOLS)) == (
        "Ask the tool.", "", [("get_weather", {"city": "Paris", "days": 2})])
    # Without tools to type them, values stay the text the model wrote (SGLang: same).
    assert summary(parse(SPEC_CALL, beam)) == ("Ask the tool.", "", [("get_weather", {"city": "Paris", "days": "2"})])


def test_beam_reasoning_and_answer(beam):
    text = "<|channel|>analysis<|message|>2+2 is 4.<|end|><|start|>assistant<|channel|>final<|message|>Four.<|return|>"
    assert summary(parse(text, beam)) == ("2+2 is 4.", "Four.", [])


def test_beam_answer_only(beam):
    assert summary(parse("<|channel|>final<|message|>Hello, world!<|return|>", beam)) == ("", "Hello, world!", [])
    # Cut off without a closer: the answer so far.
    assert summary(parse("<|channel|>final<|message|>Hel", beam)) == ("", "Hel", [])


def test_beam_reasoning_only(beam):
    assert summary(parse("<|channel|>analysis<|message|>Hmm.", beam)) == ("Hmm.", "", [])
    # Stopping after <|end|> (or inside the next header) closes the reasoning, as SGLang's _closer_rest does.
    assert summary(parse("<|channel|>analysis<|message|>Hmm.<|end|>", beam)) == ("Hmm.", "", [])
    assert summary(parse("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assi", beam)) == ("Hmm.", "", [])


def test_beam_multiple_tool_calls(beam):
    text = ("<|channel|>analysis<|message|>Two lookups.<|end|><|start|>assistant"
            + beam_call("get_weather", {"city": "Paris", "days": "3.0", "units": "null"}) + "<|end|><|start|>assistant"
            + beam_call("search", {"limit": "10", "query": "weather\nParis"}) + "<|end|><|start|>assistant"
            + beam_call("get_weather", {"city": "Rome", "options": '{"wind": true}'}) + "<|call|>")
    assert summary(parse(text, beam, tools=TOOLS)) == ("Two lookups.", "", [
        ("get_weather", {"city": "Paris", "days": 3, "units": None}),
        ("search", {"limit": 10, "query": "weather\nParis"}),
        ("get_weather", {"city": "Rome", "options": {"wind": True}}),
    ])


def test_beam_answer_then_tool_call(beam):
    text = ("<|channel|>final<|message|>Checking.<|end|><|start|>assistant"
            + beam_call("search", {"query": "x"}) + "<|call|>")
    assert summary(parse(text, beam, tools=TOOLS)) == ("", "Checking.", [("search", {"query": "x"})])


def test_beam_drops_what_sglang_drops(beam):
    # Text outside any channel, calls to tools the request did not offer, and calls cut off before
    # their closer.
    assert summary(parse("No channel at all.", beam)) == ("", "", [])
    unknown = beam_call("rm_rf", {"path": "/"}) + "<|end|><|start|>assistant" + beam_call("search", {"query": "q"})
    assert summary(parse(unknown + "<|call|>", beam, tools=TOOLS)) == ("", "", [("search", {"query": "q"})])
    assert summary(parse(unknown, beam, tools=TOOLS)) == ("", "", [])
    # ... but a call that stops inside the header after <|end|> is complete.
    assert summary(parse(beam_call("search", {"query": "q"}) + "<|end|><|sta", beam, tools=TOOLS)) == (
        "", "", [("search", {"query": "q"})])


def test_beam_cut_off_call_is_reported_incomplete_while_streaming(beam):
    events = feed_in_pieces(beam, beam_call("search", {"query": "q"}), [5] * 40, tools=TOOLS)
    assert events[0] == ToolCallStart(0, "call_0", "search")
    assert events[-1] == ToolCallEnd(0, complete=False)
    assert collect(events).tool_calls == []


def test_beam_parameter_closer_written_as_a_newline(beam):
    # Once the model writes the closer token's newline as text, the next parameter may open directly.
    text = (" to=search<|channel|>analysis <|constrain|>xml<|message|>"
            '<rfl:parameter name="limit">\n5\n'
            '<rfl:parameter name="query">\nfirst line\nsecond\n</rfl:parameter><|call|>')
    assert summary(parse(text, beam, tools=TOOLS)) == (
        "", "", [("search", {"limit": 5, "query": "first line\nsecond"})])


def test_beam_values_keep_their_text(beam):
    # Strings verbatim, including whitespace and text that looks like markup; no stripping.
    values = {"city": "  spaced  ", "query": '<rfl:parameter name="x"> </rfl:parameter>', "units": ""}
    text = beam_call("get_weather", values) + "<|call|>"
    assert parse(text, beam).tool_calls[0].arguments == values


def test_schema_casts_follow_sglang():
    assert schema_types({"anyOf": [{"type": "integer"}, {"type": "string"}], "nullable": True}) == (
        "integer", "string", "null")
    cases = [
        ("7", ["integer"], 7), ("7.0", ["integer"], 7), ("7.5", ["integer"], "7.5"), ("x", ["integer"], "x"),
        ("2", ["number"], 2), ("2.0", ["number"], 2.0), ("1e3", ["number"], 1000), ("nan", ["number"], "nan"),
        ("True", ["boolean"], True), ("0", ["boolean"], False), ("yes", ["boolean"], "yes"),
        ("None", ["null"], None), ('{"a": 1}', ["object"], {"a": 1}), ("[1]", ["object"], "[1]"),
        ("[1]", ["array"], [1]),
        # A string-or-X parameter keeps text unless it is exactly X's JSON.
        ("3", ["string", "integer"], 3), (" 3", ["string", "integer"], " 3"), ("3.0", ["string", "integer"], "3.0"),
        ("null", ["string", "null"], None), ("abc", ["string", "null"], "abc"), ("7", ["string"], "7"),
    ]
    for raw, types, expected in cases:
        value = coerce_argument(raw, types)
        assert value == expected and type(value) is type(expected), (raw, types, value)


# --- Qwen-like: the same code, other markers ---------------------------------------------------------


def test_qwen_reasoning_answer_and_calls(qwen):
    text = ("<think>\nLook it up.\n</think>\n\nLet me check.\n" + qwen_call("get_weather", {"city": "Paris", "days": 2})
            + "\n" + qwen_call("search", {"query": "rain", "limit": "5"}) + "<|im_end|>")
    assert summary(parse(text, qwen, tools=TOOLS)) == ("Look it up.", "Let me check.", [
        ("get_weather", {"city": "Paris", "days": 2}), ("search", {"query": "rain", "limit": 5})])


def test_qwen_layout_newlines_are_optional(qwen):
    text = "<think>Short.</think>Answer." + qwen_call("search", {"query": "q"}) + "<|im_end|>"
    assert summary(parse(text, qwen)) == ("Short.", "Answer.", [("search", {"query": "q"})])


def test_qwen_content_only_and_reasoning_only(qwen):
    assert summary(parse("Just an answer.\n\nTwo paragraphs.<|im_end|>", qwen)) == (
        "", "Just an answer.\n\nTwo paragraphs.", [])
    assert summary(parse("<think>\nStill thinking", qwen)) == ("Still thinking", "", [])


def test_qwen_malformed_call_stays_text_and_unknown_tool_is_dropped(qwen):
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert summary(parse("A" + bad + "<|im_end|>", qwen)) == ("", "A" + bad, [])
    unknown = qwen_call("rm_rf", {"path": "/"})
    assert summary(parse("B\n" + unknown + "<|im_end|>", qwen, tools=TOOLS)) == ("", "B", [])


def test_arguments_may_be_a_json_string(qwen):
    text = '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}\n</tool_call>'
    assert parse(text, qwen).tool_calls[0].arguments == {"query": "q"}


# --- streaming ----------------------------------------------------------------------------------------

UNICODE = "Ünïcödé 漢字 🙂👍🏽 e\u0301 \u200b<|"


def beam_outputs():
    return [
        SPEC_CALL,
        "<|channel|>analysis<|message|>Think " + UNICODE + "<|end|><|start|>assistant<|channel|>final<|message|>"
        + UNICODE + "<|return|>",
        "<|channel|>final<|message|>Send it to=bob <|end> <|channel|>fin <rfl:parameter name=\"x\">\n</rfl:parameter>"
        "<|end|><|start|>assistant" + beam_call("search", {"query": UNICODE + "\n" + '"quoted" \\ back', "limit": "3"})
        + "<|end|><|start|>assistant" + beam_call("get_weather", {"city": "Zürich"}) + "<|call|>",
        "<|channel|>analysis<|message|>only reasoning<|end|>",
        beam_call("search", {}) + "<|call|>",
        beam_call("search", {"query": "cut off mid-value <|en"}),
    ]


def qwen_outputs():
    return [
        "<think>\nPlan " + UNICODE + "\n</think>\n\nAnswer " + UNICODE + "\n"
        + qwen_call("search", {"query": UNICODE}) + "\n" + qwen_call("get_weather", {"city": "Oslo", "days": 1})
        + "<|im_end|>",
        "Text with <think and </tool_call> and <|im_en but no markers.\n\n<tool_call",
        "<think></think>\n\n" + qwen_call("search", {"query": "a\nb"}),
        "<think>\nunfinished reasoning\n</thi",
    ]


@pytest.mark.parametrize("name", ["beam", "qwen"])
def test_any_chunking_gives_the_same_events(name, beam, qwen):
    chat_format, outputs = (beam, beam_outputs()) if name == "beam" else (qwen, qwen_outputs())
    rng = random.Random(0)
    for text in outputs:
        for tools in (None, TOOLS):
            whole = merged(feed_in_pieces(chat_format, text, [len(text)], tools=tools))
            assert collect(whole) == parse(text, chat_format, tools=tools, call_id=lambda index: f"call_{index}")
            assert merged(feed_in_pieces(chat_format, text, [1] * len(text), tools=tools)) == whole, text
            for _ in range(30):
                sizes = [rng.randint(1, 12) for _ in range(len(text))]
                assert merged(feed_in_pieces(chat_format, text, sizes, tools=tools)) == whole, (text, sizes)


def test_stray_marker_like_text_is_kept(beam, qwen):
    beam_text = beam_outputs()[2]
    assert parse(beam_text, beam).content == (
        'Send it to=bob <|end> <|channel|>fin <rfl:parameter name="x">\n</rfl:parameter>')
    text = qwen_outputs()[1]
    assert summary(parse(text, qwen)) == ("", text, [])


def test_partial_markers_are_held_back(beam):
    parser = StreamingParser(beam)
    assert parser.feed("<|channel|>final<|mess") == []
    assert parser.feed("age|>Hi <|en") == [ContentDelta("Hi ")]
    assert parser.feed("dless") == [ContentDelta("<|endless")]
    assert parser.feed("<|end|><|start|>assistant<|channel|>analysis<|message|>R<|ret") == [ReasoningDelta("R")]
    assert parser.feed("urn|>anything after a stop token") == []
    assert parser.finish() == []


def test_arguments_stream_as_json_text(beam):
    query = "a long value " * 5
    text = beam_call("search", {"query": query, "limit": "2"}) + "<|call|>"
    events = feed_in_pieces(beam, text, [3] * len(text), tools=TOOLS)
    deltas = [event.text for event in events if isinstance(event, ToolCallArgumentsDelta)]
    assert events[0] == ToolCallStart(0, "call_0", "search") and events[-1] == ToolCallEnd(0)
    assert len(deltas) > 10  # the string value streams as it is written
    assert "".join(deltas) == json.dumps({"query": query, "limit": 2})


# --- both directions: render a turn, parse it back; history keeps reasoning -------------------------


def test_render_then_parse_round_trip(beam, qwen):
    rng = random.Random(1)
    words = ["alpha", "β", "漢字", "🙂", "x<y", "a\nb", '"q"', "to", "end"]
    for chat_format, template in ((beam, None), (qwen, QWEN_LIKE_TEMPLATE)):
        header = "<|start|>assistant" if template is None else "<|im_start|>assistant\n"
        for _ in range(40):
            reasoning = " ".join(rng.choices(words, k=rng.randint(0, 4))).strip()
            content = " ".join(rng.choices(words, k=rng.randint(0, 4))).strip()
            calls = [(rng.choice(["search", "get_weather"]), {"query": " ".join(rng.choices(words, k=3))})
                     for _ in range(rng.randint(0, 2))]
            message = {"role": "assistant", "reasoning_content": reasoning, "content": content,
                       "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}
                                      for name, arguments in calls]}
            user = [{"role": "user", "content": "q"}]
            before = render_chat(user, tools=TOOLS, add_generation_prompt=False, template=template)
            rendered = render_chat(user + [message], tools=TOOLS, add_generation_prompt=False, template=template)
            assert rendered.startswith(before + header)
            output = rendered[len(before + header):]
            assert summary(parse(output, chat_format)) == (reasoning, content, calls), output


def test_history_renders_reasoning_content_back(beam):
    # What the server needs on the request side: a past turn's reasoning_content goes back in.
    parsed = parse(SPEC_CALL, beam, tools=TOOLS)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", beam.reasoning_key: parsed.reasoning, "content": parsed.content,
         "tool_calls": [{"id": "call_0", "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments_json}}
                        for call in parsed.tool_calls]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    ]
    prompt = render_chat(history, tools=TOOLS)
    assert "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant" + SPEC_CALL in prompt
    assert prompt.endswith("<|start|>functions.get_weather to=assistant<|channel|>analysis<|message|>sunny<|end|>"
                           "<|start|>assistant")
