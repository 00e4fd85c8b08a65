"""A streaming parser for model output, compiled from a `ChatFormat` (learned from the chat template).

`StreamingParser(chat_format).feed(delta)` turns text as it is decoded into events: reasoning and
answer text, and tool calls whose arguments stream as OpenAI-style JSON text. Text that might be the
start of a marker is held back until the next delta decides it, so a marker is never emitted as text,
whatever the chunking. `parse(text, chat_format)` is the same parser run over a whole output.

The decoded text must keep special tokens (`skip_special_tokens=False`), including the stop token
that ended generation: Beam closes a tool call with its `<|call|>` stop token, and a call that ends
without its closer counts as cut off.

For Beam this reads output as SGLang's Beam parser does (`srt/parser/beam.py`, a response template
run by `srt/parser/chat_parsing/response_parser.py`): the same marker set, the same reasoning / answer
/ tool-call split, text between messages dropped, argument values kept verbatim as strings unless the
tool's JSON schema gives them another type (then cast as SGLang's `_coerce` casts them), calls to tools
the request did not offer and cut-off calls dropped. Where streaming forces a choice, see the notes on
`StreamingParser`.
"""

from __future__ import annotations

import enum
import json
import math
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from serving.chat.chat_format import ChatFormat, JsonCallFormat, Marker, ParameterFormat

# --- events ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0, 1, ... in the order the calls start
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    text: str  # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    # False: the output ended (or hit a stop token) before the call's closer. Its start and part of
    # its arguments were already sent; SGLang leaves such a call incomplete, and `parse` omits it.
    complete: bool = True


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    arguments_json: str  # the JSON text streamed as ToolCallArgumentsDelta
    id: str = ""


@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def collect(events: Iterable[Event]) -> ParsedOutput:
    """Fold a stream of events into the whole message; incomplete tool calls are left out."""
    parsed = ParsedOutput()
    calls: dict[int, list] = {}
    for event in events:
        if isinstance(event, ReasoningDelta):
            parsed.reasoning += event.text
        elif isinstance(event, ContentDelta):
            parsed.content += event.text
        elif isinstance(event, ToolCallStart):
            calls[event.index] = [event.id, event.name, ""]
        elif isinstance(event, ToolCallArgumentsDelta):
            calls[event.index][2] += event.text
        elif isinstance(event, ToolCallEnd) and event.complete:
            call_id, name, arguments_json = calls[event.index]
            parsed.tool_calls.append(ToolCall(name, json.loads(arguments_json), arguments_json, call_id))
    return parsed


def parse(text: str, chat_format: ChatFormat, *, tools: Sequence[Mapping[str, Any]] | None = None,
          call_id: Callable[[int], str] | None = None) -> ParsedOutput:
    """Parse a whole output (non-streaming)."""
    parser = StreamingParser(chat_format, tools=tools, call_id=call_id)
    return collect(parser.feed(text) + parser.finish())


# --- argument types (SGLang's semantics) -----------------------------------------------------------


def schema_types(schema: Any) -> tuple[str, ...]:
    """JSON types a parameter schema allows: `type` (a name or a list), `anyOf`/`oneOf`, `nullable`."""
    if not isinstance(schema, Mapping):
        return ()
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared or () if isinstance(t, str)]
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or ():
            types.extend(schema_types(choice))
    if schema.get("nullable") and "null" not in types:
        types.append("null")
    return tuple(types)


_TYPES_OF_JSON_VALUE = {bool: ("boolean",), int: ("integer", "number"), float: ("number",),
                        type(None): ("null",), dict: ("object",), list: ("array",), str: ("string",)}


def coerce_argument(raw: str, types: Sequence[str]) -> Any:
    """Cast an argument written as text to the first schema type it fits, as SGLang does for Beam.

    A parameter that may be a string keeps any text, unless the text is exactly the JSON of one of its
    other types. Integers accept whole floats ("3.0"); numbers stay ints when written without a point;
    booleans accept true/false/1/0; null accepts null/None; objects and arrays must be JSON of that
    kind. Text that fits no type stays a string.
    """
    if "string" in types and set(types) != {"string"}:
        try:
            decoded = json.loads(raw)
        except (ValueError, RecursionError):
            return raw
        if raw != raw.strip():
            return raw
        types = [name for name in types if name in _TYPES_OF_JSON_VALUE[type(decoded)]]
    for name in types:
        try:
            if name == "integer":
                try:
                    return int(raw)
                except ValueError:
                    number = float(raw)
                    if number.is_integer():
                        return int(number)
            elif name == "number":
                try:
                    return int(raw)  # exact beyond 2**53, where float() would round
                except ValueError:
                    number = float(raw)
                    if math.isfinite(number):
                        return int(number) if number.is_integer() and "." not in raw else number
            elif name == "boolean" and raw.strip().lower() in ("true", "1", "false", "0"):
                return raw.strip().lower() in ("true", "1")
            elif name == "null" and raw.strip() in ("null", "None"):
                return None
            elif name in ("object", "array"):
                decoded = json.loads(raw)
                if isinstance(decoded, dict if name == "object" else list):
                    return decoded
        except (ValueError, OverflowError, RecursionError):
            continue
    return raw


def tool_parameters(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Tool name -> its parameters' `properties`, from OpenAI-style tools (or bare functions)."""
    result: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function", tool)
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
            result[function["name"]] = dict(properties) if isinstance(properties, Mapping) else {}
    return result


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _escaped(text: str) -> str:
    """`text` escaped as the inside of a JSON string: per character, so pieces concatenate."""
    return _json_text(text)[1:-1]


# --- finding markers in a buffer -------------------------------------------------------------------


class _Found(NamedTuple):
    start: int
    end: int
    # More text could still make or change this match: nothing from `start` on may be emitted yet.
    pending: bool
    name: str | None = None


def _partial_start(text: str, literal: str, lower: int) -> int | None:
    """Where the longest proper prefix of `literal` that ends `text` starts (not before `lower`)."""
    for size in range(min(len(literal) - 1, len(text) - lower), 0, -1):
        if text.endswith(literal[:size]):
            return len(text) - size
    return None


def _back_over_newlines(text: str, index: int, lower: int, count: int) -> int:
    while count and index > lower and text[index - 1] == "\n":
        index -= 1
        count -= 1
    return index


def _find_marker(marker: Marker, text: str, pos: int, eos: bool) -> _Found | None:
    """The leftmost match of `marker` in `text[pos:]`, or a possible one cut off by the buffer end."""
    index = text.find(marker.text, pos)
    if index < 0:
        if eos:
            return None
        start = _partial_start(text, marker.text, pos)
        start = _back_over_newlines(text, len(text) if start is None else start, pos, marker.leading_newlines)
        return _Found(start, len(text), True) if start < len(text) else None
    start = _back_over_newlines(text, index, pos, marker.leading_newlines)
    end, trailing = index + len(marker.text), 0
    while trailing < marker.trailing_newlines and end < len(text) and text[end] == "\n":
        end, trailing = end + 1, trailing + 1
    # Optional newlines cut off by the buffer end may still come.
    pending = not eos and end == len(text) and trailing < marker.trailing_newlines
    return _Found(start, end, pending)


def _find_call_open(marker: Marker, name_end: str, text: str, pos: int, eos: bool) -> _Found | None:
    """The leftmost `marker` + name + `name_end`. A name is a run of non-space characters without the
    first character of `name_end` (Beam: `[^\\s<]+`, as SGLang's pattern)."""
    name_stop = name_end[0]
    search = pos
    while True:
        index = text.find(marker.text, search)
        if index < 0:
            partial = _find_marker(marker, text, search, eos)
            return partial if partial is not None and partial.pending else None
        start = _back_over_newlines(text, index, pos, marker.leading_newlines)
        name_start = index + len(marker.text)
        for _ in range(marker.trailing_newlines):
            if name_start < len(text) and text[name_start] == "\n":
                name_start += 1
        cursor = name_start
        while cursor < len(text) and text[cursor] != name_stop and not text[cursor].isspace():
            cursor += 1
        if cursor == len(text) and not eos:
            return _Found(start, len(text), True)
        if cursor > name_start:
            if text.startswith(name_end, cursor):
                return _Found(start, cursor + len(name_end), False, text[name_start:cursor])
            if not eos and name_end.startswith(text[cursor:]):
                return _Found(start, len(text), True)
        search = index + 1


# --- tool-call arguments ---------------------------------------------------------------------------


class _ParameterArguments:
    """Tagged arguments (Beam's `<rfl:parameter name="k">\\nvalue\\n</rfl:parameter>`) to streaming JSON.

    A value ends at the first `close`, or (as in SGLang's pattern) where the closer's leading newline is
    followed by the next parameter's opener: Beam's closer is one token starting with a newline, and a
    model that wrote that newline as text goes on with the next parameter. Text outside the tags is
    ignored. A value streams as a JSON string unless the tool's schema allows another type; then it is
    sent whole once it ends, cast by `coerce_argument`.
    """

    def __init__(self, parameter_format: ParameterFormat, properties: Mapping[str, Any] | None):
        self._format = parameter_format
        self._properties = properties
        leading = parameter_format.close[: len(parameter_format.close) - len(parameter_format.close.lstrip())]
        # (terminator, characters it consumes)
        self._terminators = [(parameter_format.close, len(parameter_format.close))]
        if leading:
            self._terminators.append((leading + parameter_format.open, len(leading)))
        self._pending = ""
        self._key: str | None = None
        self._whole_value_types: tuple[str, ...] | None = None  # None: the value streams as a string
        self._value = ""
        self._count = 0
        self.json_text = ""

    def feed(self, text: str) -> str:
        self._pending += text
        return self._run(eos=False)

    def close(self) -> str:
        """All arguments have been fed. A value still open keeps what it has (SGLang drops it)."""
        out = self._run(eos=True)
        if self._key is not None:
            out += self._value_text(self._pending) + self._end_value()
        self._pending = ""
        out += "}" if self._count else "{}"
        self.json_text += "}" if self._count else "{}"
        return out

    def _run(self, eos: bool) -> str:
        out = []
        while True:
            text = self._pending
            if self._key is None:
                head = self._find_head(text, eos)
                if head is None:
                    keep = None if eos else _partial_start(text, self._format.open, 0)
                    self._pending = "" if keep is None else text[keep:]
                    break
                if head.pending:
                    self._pending = text[head.start:]
                    break
                self._pending = text[head.end:]
                out.append(self._start_value(head.name))
                continue
            end, consumed = None, 0
            for terminator, length in self._terminators:
                index = text.find(terminator)
                if index >= 0 and (end is None or index < end):
                    end, consumed = index, length
            hold = len(text)
            if not eos:
                for terminator, _ in self._terminators:
                    partial = _partial_start(text, terminator, 0)
                    if partial is not None:
                        hold = min(hold, partial)
            if end is not None and end < hold:
                out.append(self._value_text(text[:end]) + self._end_value())
                self._pending = text[end + consumed:]
                continue
            if eos:
                break  # close() ends the open value
            out.append(self._value_text(text[:hold]))
            self._pending = text[hold:]
            break
        delta = "".join(out)
        self.json_text += delta
        return delta

    def _find_head(self, text: str, eos: bool) -> _Found | None:
        """The leftmost `open` + key + `name_end`; a key is a run without `name_end`'s first character."""
        parameter_format = self._format
        key_stop = parameter_format.name_end[0]
        search = 0
        while True:
            index = text.find(parameter_format.open, search)
            if index < 0:
                return None
            key_start = cursor = index + len(parameter_format.open)
            while cursor < len(text) and text[cursor] != key_stop:
                cursor += 1
            if cursor == len(text):
                if not eos:
                    return _Found(index, len(text), True)
            elif cursor > key_start:
                if text.startswith(parameter_format.name_end, cursor):
                    return _Found(index, cursor + len(parameter_format.name_end), False, text[key_start:cursor])
                if not eos and parameter_format.name_end.startswith(text[cursor:]):
                    return _Found(index, len(text), True)
            search = index + 1

    def _start_value(self, key: str) -> str:
        self._key, self._value = key, ""
        types = schema_types(self._properties.get(key)) if self._properties else ()
        if self._format.json_values:
            self._whole_value_types = types
        elif types and set(types) != {"string"}:
            self._whole_value_types = types
        else:
            self._whole_value_types = None
        opening = ("{" if self._count == 0 else ", ") + _json_text(key) + ": "
        self._count += 1
        return opening + ('"' if self._whole_value_types is None else "")

    def _value_text(self, text: str) -> str:
        if self._whole_value_types is None:
            return _escaped(text)
        self._value += text
        return ""

    def _end_value(self) -> str:
        types, raw = self._whole_value_types, self._value
        self._key, self._value, self._whole_value_types = None, "", None
        if types is None:
            return '"'
        if self._format.json_values:
            try:
                return _json_text(json.loads(raw))
            except (ValueError, RecursionError):
                return _json_text(raw)
        return _json_text(coerce_argument(raw, types))


def _parse_json_call(body: str, json_format: JsonCallFormat) -> tuple[str, dict[str, Any]] | None:
    try:
        call = json.loads(body.strip())
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get(json_format.name_key), str):
        return None
    arguments = call.get(json_format.arguments_key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return call[json_format.name_key], arguments


# --- the parser ------------------------------------------------------------------------------------


class _State(enum.Enum):
    OUTSIDE = "outside"  # between parts; the answer when it has no opener
    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"
    DROPPED_CALL = "dropped call"  # a call to a tool the request did not offer
    DONE = "done"


class _Action(enum.Enum):
    OPEN_REASONING = 0
    OPEN_CONTENT = 1
    OPEN_CALL = 2
    CLOSE = 3
    STOP = 4


@dataclass(frozen=True)
class _Watch:
    marker: Marker
    action: _Action
    call_name_end: str | None = None  # set for a tool-call opener that carries the name
    stops: bool = False  # the closer is also a stop token

    def find(self, text: str, pos: int, eos: bool) -> _Found | None:
        if self.call_name_end is not None:
            return _find_call_open(self.marker, self.call_name_end, text, pos, eos)
        return _find_marker(self.marker, text, pos, eos)


@dataclass
class _OpenCall:
    index: int = -1
    arguments: _ParameterArguments | None = None  # tagged parameters
    body: str = ""  # a JSON call's text, parsed at its closer
    raw: str = ""


def _random_call_id(index: int) -> str:
    return "call_" + uuid.uuid4().hex[:24]


class StreamingParser:
    """Incremental parser of one output. `feed(delta)` returns the events the text so far decides;
    `finish()` ends the output and returns the rest.

    `tools` (OpenAI-style, optional): when given, calls to other tools are dropped and argument values
    are cast to their schema types, as SGLang does; without it every call is reported and tagged
    values stay strings.

    Where streaming meets SGLang's whole-output semantics:
    - Tagged argument values stream as they are written; a value the call's closer cuts off keeps its
      text, where SGLang drops the parameter (well-formed output is unaffected).
    - A stop token ends the output: an open part ends there, and the token is never part of its text.
    - A JSON tool call is sent whole at its closer; one whose JSON does not parse is returned as answer
      text, so nothing the model wrote is lost.
    """

    def __init__(self, chat_format: ChatFormat, *, tools: Sequence[Mapping[str, Any]] | None = None,
                 call_id: Callable[[int], str] | None = None):
        self.chat_format = chat_format
        self._tool_parameters = None if tools is None else tool_parameters(tools)
        self._call_id = call_id or _random_call_id
        self._buffer = ""
        self._state = _State.OUTSIDE
        self._call: _OpenCall | None = None
        self._calls_started = 0
        self._watches = self._compile(chat_format)

    # The markers each state looks for: openers first (SGLang prefers an opener on a tie), then closers,
    # then stop tokens.
    @staticmethod
    def _compile(chat_format: ChatFormat) -> dict[_State, list[_Watch]]:
        stop_tokens = set(chat_format.stop_tokens)

        def closers(markers: Sequence[Marker]) -> list[_Watch]:
            watches = [_Watch(marker, _Action.CLOSE, stops=marker.text in stop_tokens) for marker in markers]
            closed = {marker.text for marker in markers}
            return watches + [_Watch(Marker(token), _Action.STOP) for token in chat_format.stop_tokens
                              if token not in closed]

        outside = []
        if chat_format.reasoning_open is not None:
            outside.append(_Watch(chat_format.reasoning_open, _Action.OPEN_REASONING))
        if chat_format.content_open is not None:
            outside.append(_Watch(chat_format.content_open, _Action.OPEN_CONTENT))
        tool_call = chat_format.tool_call
        if tool_call is not None:
            name_end = tool_call.name_end if tool_call.parameters is not None else None
            outside.append(_Watch(tool_call.open, _Action.OPEN_CALL, call_name_end=name_end))
        # With no opener the answer is outside text, and its closer ends it there.
        outside += closers(chat_format.content_close if chat_format.content_open is None else ())
        call_closers = closers(tool_call.close if tool_call is not None else ())
        return {
            _State.OUTSIDE: outside,
            _State.REASONING: closers(chat_format.reasoning_close),
            _State.CONTENT: closers(chat_format.content_close),
            _State.CALL: call_closers,
            _State.DROPPED_CALL: call_closers,
        }

    def feed(self, text: str) -> list[Event]:
        if self._state is _State.DONE:
            return []
        self._buffer += text
        events: list[Event] = []
        self._run(events, eos=False)
        return events

    def finish(self) -> list[Event]:
        if self._state is _State.DONE:
            return []
        self._complete_cut_closer()
        events: list[Event] = []
        self._run(events, eos=True)
        if self._state is not _State.DONE:
            self._end_part(events, complete=False)
            self._state = _State.DONE
        return events

    def _complete_cut_closer(self) -> None:
        """An output that stops inside a closer ending with the next message's header (Beam: after the
        `<|end|>` of `<|end|><|start|>assistant`) closes the part, as SGLang's `_closer_rest` does."""
        header = self.chat_format.message_start
        if not header:
            return
        for watch in self._watches.get(self._state, ()):
            closer = watch.marker.text
            if watch.action is not _Action.CLOSE or closer == header or not closer.endswith(header):
                continue
            for cut in range(len(closer) - 1, len(closer) - len(header) - 1, -1):
                if self._buffer.endswith(closer[:cut]):
                    self._buffer += closer[cut:]
                    return

    def _run(self, events: list[Event], eos: bool) -> None:
        text, pos = self._buffer, 0
        while self._state is not _State.DONE:
            best: tuple[tuple[int, int, int], _Found, _Watch] | None = None
            hold = len(text)
            for order, watch in enumerate(self._watches[self._state]):
                found = watch.find(text, pos, eos)
                if found is None:
                    continue
                if found.pending:
                    hold = min(hold, found.start)
                    continue
                key = (found.start, found.start - found.end, order)  # leftmost, then longest
                if best is None or key < best[0]:
                    best = (key, found, watch)
            # A match may fire only before every undecided one: an earlier could still turn out real.
            if best is not None and best[1].start < hold:
                _, found, watch = best
                self._text(text[pos:found.start], events)
                pos = found.end
                self._act(watch, found, text[found.start:found.end], events)
                continue
            end = len(text) if eos else hold
            self._text(text[pos:end], events)
            pos = end
            break
        self._buffer = "" if self._state is _State.DONE else text[pos:]

    def _act(self, watch: _Watch, found: _Found, marker_text: str, events: list[Event]) -> None:
        if watch.action is _Action.OPEN_REASONING:
            self._state = _State.REASONING
        elif watch.action is _Action.OPEN_CONTENT:
            self._state = _State.CONTENT
        elif watch.action is _Action.OPEN_CALL:
            self._open_call(found.name, marker_text, events)
        elif watch.action is _Action.CLOSE:
            if self._call is not None:
                self._call.raw += marker_text
            self._end_part(events, complete=True)
            self._state = _State.DONE if watch.stops else _State.OUTSIDE
        else:  # a stop token that does not close the open part: the output ends here
            self._end_part(events, complete=False)
            self._state = _State.DONE

    def _open_call(self, name: str | None, marker_text: str, events: list[Event]) -> None:
        tool_call = self.chat_format.tool_call
        if tool_call.json is not None:  # the name comes with the JSON at the closer
            self._call = _OpenCall(raw=marker_text)
            self._state = _State.CALL
            return
        if self._tool_parameters is not None and name not in self._tool_parameters:
            self._state = _State.DROPPED_CALL
            return
        index = self._calls_started
        self._calls_started += 1
        properties = self._tool_parameters.get(name) if self._tool_parameters is not None else None
        self._call = _OpenCall(index, _ParameterArguments(tool_call.parameters, properties))
        self._state = _State.CALL
        events.append(ToolCallStart(index, self._call_id(index), name))

    def _end_part(self, events: list[Event], complete: bool) -> None:
        call, self._call = self._call, None
        if self._state is not _State.CALL or call is None:
            return
        if call.arguments is not None:
            if complete:
                self._emit(events, ToolCallArgumentsDelta(call.index, call.arguments.close()))
            events.append(ToolCallEnd(call.index, complete))
            return
        if not complete:
            return  # a JSON call cut off before its closer is dropped, as SGLang drops it
        parsed = _parse_json_call(call.body, self.chat_format.tool_call.json)
        if parsed is None:
            self._emit(events, ContentDelta(call.raw))
            return
        name, arguments = parsed
        if self._tool_parameters is not None:
            if name not in self._tool_parameters:
                return
            properties = self._tool_parameters[name]
            for key, value in arguments.items():
                types = schema_types(properties.get(key))
                # JSON says when a value is a string: cast it only where the schema allows no string.
                if isinstance(value, str) and types and "string" not in types:
                    arguments[key] = coerce_argument(value, types)
        index = self._calls_started
        self._calls_started += 1
        events += [ToolCallStart(index, self._call_id(index), name),
                   ToolCallArgumentsDelta(index, _json_text(arguments)), ToolCallEnd(index)]

    def _text(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        state = self._state
        if state is _State.REASONING:
            self._emit(events, ReasoningDelta(text))
        elif state is _State.CONTENT or (state is _State.OUTSIDE and self.chat_format.content_open is None):
            self._emit(events, ContentDelta(text))
        elif state is _State.CALL:
            self._call.raw += text
            if self._call.arguments is not None:
                self._emit(events, ToolCallArgumentsDelta(self._call.index, self._call.arguments.feed(text)))
            else:
                self._call.body += text
        # Otherwise dropped: text between messages (Beam), or a dropped call.

    @staticmethod
    def _emit(events: list[Event], event: Event) -> None:
        """Append, merging with a preceding delta of the same kind."""
        if not event.text:
            return
        last = events[-1] if events else None
        if type(last) is type(event) and getattr(last, "index", None) == getattr(event, "index", None):
            events[-1] = type(event)(**{**last.__dict__, "text": last.text + event.text})
        else:
            events.append(event)
