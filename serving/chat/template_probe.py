"""Learn a model's output grammar from its chat template.

The template already knows how the model writes reasoning, answers and tool calls: it writes them
back into the prompt for past turns. So render assistant turns made of sentinel text (a reasoning
sentinel, an answer sentinel, tool calls with sentinel names and arguments), each time with one piece
more or less, and read the literal text around each sentinel: that is the marker. The result, a
`ChatFormat`, is then checked by parsing every probe render back into its sentinels.

Works for HF-style templates that take `messages`, `tools` and `add_generation_prompt`, with the
assistant turn starting with the generation prompt: Beam's Harmony-like format and ChatML-style
formats (`<think>` reasoning, JSON tool calls in `<tool_call>` tags) alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import jinja2

from beam_jax.tokenizer import STOP_TOKENS, render_chat
from serving.chat.chat_format import (
    ChatFormat,
    JsonCallFormat,
    Marker,
    ParameterFormat,
    ToolCallFormat,
    merge_markers,
)
from serving.chat.parser import parse

# render(messages, tools, add_generation_prompt) -> prompt text
Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, bool], str]

# Sentinels: plain words (any template renders them verbatim) starting with different letters, so
# that no two of them share a prefix with each other or with markers.
USER = "Uq7 probe question"
REASONING = "Rz5 probe reasoning"
CONTENT = "Cx3 probe answer"
TOOL_NAMES = ("probe_tool_alpha", "probe_tool_beta")
STRING_KEY, INTEGER_KEY = "probe_key_a", "probe_key_b"
STRING_VALUE, INTEGER_VALUE = "Vw8 probe value", 73019
# Fields templates read past reasoning from (Qwen3 and Beam: reasoning_content; gpt-oss: thinking).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")

PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": "A probe.",
            "parameters": {
                "type": "object",
                "properties": {STRING_KEY: {"type": "string"}, INTEGER_KEY: {"type": "integer"}},
            },
        },
    }
    for name in TOOL_NAMES
]
ONE_ARGUMENT = {STRING_KEY: STRING_VALUE}
TWO_ARGUMENTS = {STRING_KEY: STRING_VALUE, INTEGER_KEY: INTEGER_VALUE}


def render_with(template: str | None = None, **template_kwargs: Any) -> Render:
    """A `Render` through beam_jax's renderer (transformers' Jinja environment); None: Beam's template."""

    def render(messages, tools, add_generation_prompt):
        return render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           template=template, **template_kwargs)

    return render


def learn_chat_format(template: str | None = None, *, stop_tokens: Sequence[str] = (),
                      render: Render | None = None) -> ChatFormat:
    """Learn the output grammar of `template` (a Jinja chat template; None: Beam's shipped one).

    `stop_tokens`: the strings that end generation (for Beam `<|return|>` and `<|call|>`); a template
    only renders past turns, so it cannot tell which closer the model writes last. `render` replaces
    the renderer (for templates that need other variables). Raises ValueError when the template's
    output cannot be described or the description does not read the template's own renders back.
    """
    if render is None:
        return _learn_cached(template, tuple(stop_tokens))
    return _learn(render, tuple(stop_tokens))


@lru_cache(maxsize=8)
def _learn_cached(template: str | None, stop_tokens: tuple[str, ...]) -> ChatFormat:
    return _learn(render_with(template), stop_tokens)


def beam_chat_format() -> ChatFormat:
    """Beam's format, learned from the shipped template, with Beam's stop tokens."""
    return learn_chat_format(None, stop_tokens=STOP_TOKENS)


# --- rendering probes ------------------------------------------------------------------------------


def _call(name: str, arguments: Mapping[str, Any], index: int = 0) -> dict[str, Any]:
    return {"id": f"call_probe_{index}", "type": "function", "function": {"name": name, "arguments": dict(arguments)}}


def _assistant(reasoning_key: str | None = None, content: str = "",
               calls: Sequence[tuple[str, Mapping[str, Any]]] = ()) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning_key is not None:
        message[reasoning_key] = REASONING
    if calls:
        message["tool_calls"] = [_call(name, arguments, index) for index, (name, arguments) in enumerate(calls)]
    return message


class _Probe:
    """Renders assistant turns after one user turn and returns what the model would have written."""

    def __init__(self, render: Render):
        self._render = render
        user = [{"role": "user", "content": USER}]
        self._before = render(user, PROBE_TOOLS, False)
        prompt = render(user, PROBE_TOOLS, True)
        if not prompt.startswith(self._before) or prompt == self._before:
            raise ValueError("the generation prompt does not extend the conversation")
        self.header = prompt[len(self._before):]
        self.renders: list[tuple[str, dict[str, Any]]] = []  # (output, the message), for the check

    def output(self, message: dict[str, Any]) -> str:
        rendered = self._render([{"role": "user", "content": USER}, message], PROBE_TOOLS, False)
        start = self._before + self.header
        if not rendered.startswith(start):
            raise ValueError("an assistant turn does not start with the generation prompt: "
                             f"{rendered[len(self._before):][:80]!r} vs {self.header!r}")
        output = rendered[len(start):]
        self.renders.append((output, message))
        return output


def _split_once(text: str, sentinel: str, what: str) -> tuple[str, str]:
    if text.count(sentinel) != 1:
        raise ValueError(f"{what}: expected the sentinel {sentinel!r} once in {text!r}")
    before, _, after = text.partition(sentinel)
    return before, after


def _common_suffix(first: str, second: str) -> str:
    size = 0
    while size < min(len(first), len(second)) and first[-1 - size] == second[-1 - size]:
        size += 1
    return first[len(first) - size:]


def _without_suffix(text: str, suffix: str) -> str:
    return text[: len(text) - len(suffix)] if suffix and text.endswith(suffix) else text


# --- learning --------------------------------------------------------------------------------------


def _learn(render: Render, stop_tokens: tuple[str, ...]) -> ChatFormat:
    probe = _Probe(render)
    answer = probe.output(_assistant(content=CONTENT))
    content_before, content_after = _split_once(answer, CONTENT, "answer")

    reasoning_key = reasoning_open = None
    reasoning_close: tuple[Marker, ...] = ()
    content_open_text = content_before
    empty_blocks = []  # what the template writes for a missing part, seen before a tool call
    for key in REASONING_KEYS:
        both = probe.output(_assistant(key, CONTENT))
        if REASONING not in both:
            continue
        reasoning_key = key
        reasoning_before, rest = _split_once(both, REASONING, "reasoning and answer")
        between, after = _split_once(rest, CONTENT, "reasoning and answer")
        if after != content_after:
            raise ValueError(f"the answer ends differently after reasoning: {after!r} vs {content_after!r}")
        if content_before and between.endswith(content_before):
            reasoning_close_text = between[: len(between) - len(content_before)]  # the answer has an opener
        elif content_before in ("", reasoning_before + between):
            content_open_text, reasoning_close_text = "", between  # the answer has none
            empty_blocks.append(content_before)  # Qwen3 writes an empty <think></think> block
        else:
            raise ValueError(f"cannot tell the reasoning closer from the answer opener in {between!r}")
        reasoning_open = Marker.from_rendered(reasoning_before)
        reasoning_close = (Marker.from_rendered(reasoning_close_text),)
        break
    content_open = Marker.from_rendered(content_open_text) if content_open_text else None
    content_close = (Marker.from_rendered(content_after),) if content_after.strip("\n") else ()
    if content_open is not None:
        empty_blocks.append(content_open_text + content_after)

    def strip_preamble(output: str) -> str:
        for block in empty_blocks:
            if block and output.startswith(block):
                output = output[len(block):]
        return output

    tool_call = _learn_tool_call(probe, strip_preamble, content_after)
    chat_format = ChatFormat(
        message_start=probe.header,
        reasoning_key=reasoning_key,
        reasoning_open=reasoning_open,
        reasoning_close=reasoning_close,
        content_open=content_open,
        content_close=content_close,
        tool_call=tool_call,
        stop_tokens=stop_tokens,
    )
    _check(chat_format, probe.renders)
    return chat_format


def _learn_tool_call(probe: _Probe, strip_preamble: Callable[[str], str], message_end: str) -> ToolCallFormat | None:
    name = TOOL_NAMES[0]
    try:
        one = probe.output(_assistant(calls=[(name, ONE_ARGUMENT)]))
    except jinja2.TemplateError:
        return None
    if name not in one:
        return None  # the template does not write tool calls
    one = strip_preamble(one)
    found = _find_json_call(one, name, ONE_ARGUMENT)
    if found is not None:
        return _learn_json_call(probe, strip_preamble, message_end, one, found)
    return _learn_parameter_call(probe, strip_preamble, message_end, one)


def _find_json_call(text: str, name: str, arguments: Mapping[str, Any],
                    start: int = 0) -> tuple[int, int, JsonCallFormat] | None:
    """The first JSON object in `text[start:]` holding `name` and `arguments` (as an object or a JSON
    string): (start, end, JsonCallFormat), or None."""
    decoder = json.JSONDecoder()
    for index in range(start, len(text)):
        if text[index] != "{":
            continue
        try:
            value, end = decoder.raw_decode(text, index)
        except ValueError:
            continue
        if not isinstance(value, dict):
            continue
        name_key = next((key for key, item in value.items() if item == name), None)
        for key, item in value.items():
            as_string = isinstance(item, str)
            if as_string:
                try:
                    item = json.loads(item)
                except ValueError:
                    continue
            if name_key is not None and item == arguments:
                return index, end, JsonCallFormat(name_key, key, as_string)
    return None


def _newlines_before(probe: _Probe, open_text: str, locate_call: Callable[[str], int]) -> int:
    """Layout newlines the template puts between an answer and a call (Qwen: one)."""
    mixed = probe.output(_assistant(content=CONTENT, calls=[(TOOL_NAMES[0], ONE_ARGUMENT)]))
    answer_end = mixed.find(CONTENT) + len(CONTENT)
    gap = mixed[answer_end: locate_call(mixed)]
    if gap.endswith(open_text) and not gap[: len(gap) - len(open_text)].strip("\n"):
        return len(gap) - len(open_text)
    return 0


def _learn_json_call(probe: _Probe, strip_preamble: Callable[[str], str], message_end: str, one: str,
                     found: tuple[int, int, JsonCallFormat]) -> ToolCallFormat:
    start, end, json_format = found
    open_text = one[:start]
    close_last = _without_suffix(one[end:], message_end)
    two = strip_preamble(probe.output(_assistant(calls=[(TOOL_NAMES[0], ONE_ARGUMENT), (TOOL_NAMES[1], ONE_ARGUMENT)])))
    first = _find_json_call(two, TOOL_NAMES[0], ONE_ARGUMENT)
    second = _find_json_call(two, TOOL_NAMES[1], ONE_ARGUMENT, first[1]) if first else None
    if second is None:
        raise ValueError(f"cannot find two JSON tool calls in {two!r}")
    between = two[first[1]: second[0]]
    if not open_text.strip("\n") or not between.endswith(open_text):
        raise ValueError(f"cannot find the tool-call opener {open_text!r} between calls in {between!r}")
    closers = [close_last, between[: len(between) - len(open_text)]]
    lead = _newlines_before(probe, open_text,
                            lambda mixed: _find_json_call(mixed, TOOL_NAMES[0], ONE_ARGUMENT)[0])
    return ToolCallFormat(
        open=Marker.from_rendered("\n" * lead + open_text),
        close=merge_markers([Marker.from_rendered(closer) for closer in closers if closer.strip("\n")]),
        json=json_format,
    )


def _learn_parameter_call(probe: _Probe, strip_preamble: Callable[[str], str], message_end: str,
                          one: str) -> ToolCallFormat:
    """Arguments as tags around each name and value (Beam). From renders of a call without arguments,
    with one string and one integer argument, and of two calls."""
    name = TOOL_NAMES[0]
    open_text = one[: one.index(name)]
    if not open_text.strip():
        raise ValueError(f"no text opens a tool call before its name in {one!r}")
    after_name = lambda output: output[len(open_text) + len(name):]  # noqa: E731
    zero = strip_preamble(probe.output(_assistant(calls=[(name, {})])))
    two = strip_preamble(probe.output(_assistant(calls=[(name, TWO_ARGUMENTS)])))
    for output in (zero, two):
        if not output.startswith(open_text + name):
            raise ValueError(f"tool calls start differently: {output!r} vs {open_text + name!r}")
    no_arguments = _without_suffix(after_name(zero), message_end)
    arguments = _without_suffix(after_name(two), message_end)

    # Where each key and value sits, in the order written.
    spans = {}
    for key, value in ((STRING_KEY, STRING_VALUE), (INTEGER_KEY, str(INTEGER_VALUE))):
        key_start = arguments.find(key)
        value_start = arguments.find(value, key_start + len(key))
        if key_start < 0 or value_start < 0:
            raise ValueError(f"cannot find argument {key!r} in {arguments!r}")
        spans[key] = [key_start, key_start + len(key), value_start, value_start + len(value)]
    string_mid = arguments[spans[STRING_KEY][1]: spans[STRING_KEY][2]]
    integer_mid = arguments[spans[INTEGER_KEY][1]: spans[INTEGER_KEY][2]]
    if string_mid == integer_mid:
        json_values = False  # strings verbatim, other values as JSON
    elif string_mid == integer_mid + '"' and arguments[spans[STRING_KEY][3]] == '"':
        json_values = True
        spans[STRING_KEY][2] -= 1
        spans[STRING_KEY][3] += 1
    else:
        raise ValueError(f"arguments are written differently by type: {string_mid!r} vs {integer_mid!r}")
    first, second = sorted(spans.values())
    before_first = arguments[: first[0]]  # name end + parameter open
    between = arguments[first[3]: second[0]]  # parameter close + separator + parameter open
    after_last = arguments[second[3]:]  # parameter close + call close
    # The parameter opener ends both; leave at least one character to end the name.
    parameter_open = _common_suffix(before_first, between)
    parameter_open = parameter_open[max(0, len(parameter_open) - len(before_first) + 1):]
    name_end = before_first[: len(before_first) - len(parameter_open)]
    if not no_arguments.startswith(name_end):
        raise ValueError(f"the tool name ends differently without arguments: {no_arguments!r}")
    close_last = no_arguments[len(name_end):]
    if not close_last.strip("\n") or not after_last.endswith(close_last):
        raise ValueError(f"cannot find the tool-call closer in {no_arguments!r} and {after_last!r}")
    parameter_close = after_last[: len(after_last) - len(close_last)]
    close_and_separator = between[: len(between) - len(parameter_open)]
    if not parameter_close or not close_and_separator.startswith(parameter_close):
        raise ValueError(f"cannot find the parameter closer in {between!r} and {after_last!r}")
    parameters = ParameterFormat(
        open=parameter_open,
        name_end=arguments[first[1]: first[2]],
        close=parameter_close,
        separator=close_and_separator[len(parameter_close):],
        json_values=json_values,
    )

    # A call that is not the last one may close differently (Beam: <|end|> and the next header).
    calls = strip_preamble(probe.output(_assistant(calls=[(name, ONE_ARGUMENT), (TOOL_NAMES[1], ONE_ARGUMENT)])))
    value = json.dumps(STRING_VALUE) if json_values else STRING_VALUE
    first_call = (open_text + name + name_end + parameters.open + STRING_KEY + parameters.name_end + value
                  + parameters.close)
    second_start = calls.find(open_text + TOOL_NAMES[1], len(first_call))
    if not calls.startswith(first_call) or second_start < 0:
        raise ValueError(f"cannot find two tool calls in {calls!r}")
    closers = [close_last, calls[len(first_call): second_start]]
    lead = _newlines_before(probe, open_text, lambda mixed: mixed.find(open_text + name))
    return ToolCallFormat(
        open=Marker.from_rendered("\n" * lead + open_text),
        close=merge_markers([Marker.from_rendered(closer) for closer in closers if closer.strip("\n")]),
        name_end=name_end,
        parameters=parameters,
    )


def _check(chat_format: ChatFormat, renders: list[tuple[str, dict[str, Any]]]) -> None:
    """Every probe render must parse back into the message it was rendered from."""
    for output, message in renders:
        parsed = parse(output, chat_format, tools=PROBE_TOOLS)
        # Renders with a reasoning field the template does not read show no reasoning.
        expected_reasoning = message.get(chat_format.reasoning_key, "") if chat_format.reasoning_key else ""
        expected_calls = [(call["function"]["name"], call["function"]["arguments"])
                          for call in message.get("tool_calls", ()) if chat_format.tool_call is not None]
        got = (parsed.reasoning, parsed.content, [(call.name, call.arguments) for call in parsed.tool_calls])
        if got != (expected_reasoning, message["content"], expected_calls):
            raise ValueError(f"the learned format reads the template's render {output!r} as {got!r}")
