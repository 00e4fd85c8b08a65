"""Grammar-constrained decoding with xgrammar: what a request's output must look like, compiled
against the tokenizer's vocabulary into a matcher that gives a token bitmask per step.

A `Grammar` is an xgrammar structural tag (JSON text) plus the stop tokens allowed to end it. It is
built on the host from what the request asks for, in the model's chat format (`ChatFormat`, learned
from the chat template), so that the constrained output still parses as a chat turn
(`ChatGrammars`):

- `json_output(schema)`: the answer is JSON (any object, or one matching a JSON schema); in a chat
  format, after the answer opener (Beam: `<|channel|>final<|message|>`), ended by the answer's stop
  token (`<|return|>`);
- `forced_tool_calls(tools, name=...)`: the turn is a tool call (of the named tool, or of any offered
  one: `tool_choice=required`), its arguments in the template's encoding and matching the tool's
  parameter schema. Beam: ` to=NAME<|channel|>analysis <|constrain|>xml<|message|>`, then one
  `<rfl:parameter name="k">\\nvalue\\n</rfl:parameter>` per argument (names sorted, as the
  template writes them; strings verbatim, other types as JSON), closed by the `<|call|>` stop token;
- `tool_calls_once_started(tools)` (`tool_choice=auto`): free output, but once the call opener
  (` to=`) appears, the rest of that call is a call of an offered tool with valid arguments (an
  xgrammar triggered tag).

The forced forms may start with one reasoning block of at most `reasoning_tokens` tokens (a reasoning
model reasons first; the cap keeps room for the constrained part). JSON is compact (", " and ": "
separators, no other whitespace): unbounded whitespace is the classic way a constrained model wanders.

`GrammarBackend` (one per engine) compiles grammars for the tokenizer, with every stop token of the
engine as an xgrammar stop token (so none can appear inside the grammar: a JSON string never holds a
`<|call|>` that would end generation), and makes one `Matcher` per request. Per step the engine fills
the request's row of an int32 bitmask `[batch, ceil(vocab / 32)]` (bit t % 32 of word t // 32 set:
token t allowed; all ones: unconstrained), the compiled sampling step applies it, and the engine feeds
the sampled token back. When the grammar is complete only stop tokens are allowed, and of those only
the grammar's own (a forced call ends with `<|call|>`, never `<|return|>`); a matcher that accepted
one is terminated, and the engine ends the request.

xgrammar imports torch, which takes seconds: it is imported when the first backend is made.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from serving.chat.chat_format import ChatFormat, ParameterFormat
from serving.chat.parser import schema_types


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What one request's output must match. Hashable, so requests share compiled grammars."""

    structural_tag: str  # an xgrammar StructuralTag, as JSON text
    stop_tokens: tuple[str, ...] = ()  # the stop tokens (text) that may end it; (): any of the engine's


# ---- building grammars (host, tokenizer-free) -----------------------------------------------------
def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _sequence(*elements: dict | None) -> dict:
    elements = [e for e in elements if e is not None]
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _one_of(elements: Sequence[dict]) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": list(elements)}


def _optional(content: dict) -> dict:
    return {"type": "optional", "content": content}


def _tag(begin: str, content: dict, end: str | list[str]) -> dict:
    # Free text (any_text) is only ever a tag's content: in xgrammar 0.2 its masks are wrong (they
    # allow tokens the matcher then refuses) when it is bounded and sits in a plain sequence.
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _free_text(excludes: Iterable[str], *, max_tokens: int | None = None) -> dict:
    text = {"type": "any_text", "excludes": sorted(set(excludes))}
    if max_tokens is not None:
        text["max_tokens"] = max_tokens
    return text


# xgrammar 0.2 lets the characters of length-bounded JSON strings include control characters, which
# strict JSON (and Python's json.loads) rejects; its unbounded strings exclude them, as here.
_LOOSE_JSON_CHARACTER = r'[^\"\\\r\n]'
_JSON_CHARACTER = r'[^\0-\x1f\"\\]'


def _message(error: Exception) -> str:
    """xgrammar's error text without its `[time] file.cc:line:` prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())


@functools.lru_cache(maxsize=256)
def _json_ebnf(schema_json: str) -> str:
    import xgrammar

    try:
        grammar = xgrammar.Grammar.from_json_schema(json.loads(schema_json), any_whitespace=False)
    except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError / InvalidJSONError
        raise ValueError(f"the JSON schema cannot be used for constrained decoding: {_message(error)}") from error
    return str(grammar).replace(_LOOSE_JSON_CHARACTER, _JSON_CHARACTER)


def json_value(schema: Mapping[str, Any] | bool | None) -> dict:
    """Compact JSON matching `schema` (None: any JSON object)."""
    schema = {"type": "object"} if schema is None else schema
    return {"type": "grammar", "grammar": _json_ebnf(json.dumps(schema, sort_keys=True))}


class ChatGrammars:
    """Grammars in one chat format. `special_tokens`: the tokenizer's control tokens (as text), kept
    out of free text (reasoning, string arguments) so that it cannot fake a marker."""

    def __init__(self, chat_format: ChatFormat | None, special_tokens: Iterable[str] = ()):
        self.chat_format = chat_format
        self.special_tokens = tuple(special_tokens)
        stops = chat_format.stop_tokens if chat_format else ()
        call = chat_format.tool_call if chat_format else None
        call_closers = {m.text for m in call.close} if call else set()
        # The answer ends with a stop token that does not close a call (Beam: <|return|>).
        self.answer_stops = tuple(t for t in stops if t not in call_closers) or tuple(stops)

    # -- the pieces ---------------------------------------------------------------------------------
    def _reasoning(self, max_tokens: int) -> dict | None:
        chat = self.chat_format
        if max_tokens <= 0 or chat is None or chat.reasoning_open is None or not chat.reasoning_close:
            return None
        close = chat.reasoning_close[0].text
        text = _free_text([close, *self.special_tokens], max_tokens=max_tokens)
        return _optional(_tag(chat.reasoning_open.text, text, close))

    def _parameters(self, parameter_format: ParameterFormat, schema: Mapping[str, Any]) -> dict | None:
        """Tagged arguments in sorted order (the template's `dictsort`), the optional ones optional,
        joined by the separator."""
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        names = sorted(properties)
        if not names:
            return None
        tags = [self._parameter(parameter_format, name, properties[name], schema) for name in names]
        separator = _const(parameter_format.separator) if parameter_format.separator else None
        # rest[i]: the arguments from i on, each after a separator; first[i]: from i on, the first
        # without one. O(n^2) nodes at worst (a tree: xgrammar formats cannot share a node).
        rest: dict | None = None
        first: dict | None = None
        for i in reversed(range(len(names))):
            after = _sequence(separator, tags[i])
            own_first = _sequence(tags[i], rest) if rest is not None else tags[i]
            if names[i] in required:
                first = own_first
                rest = _sequence(after, rest) if rest is not None else after
            else:
                first = _one_of([own_first, first]) if first is not None else _optional(own_first)
                rest = _sequence(_optional(after), rest) if rest is not None else _optional(after)
        return first

    def _parameter(self, parameter_format: ParameterFormat, name: str, schema: Any, root: Mapping[str, Any]) -> dict:
        begin = parameter_format.open + name + parameter_format.name_end
        close = parameter_format.close
        # The parser also ends a value where the closer's newline is followed by the next opener.
        leading = close[: len(close) - len(close.lstrip())]
        excludes = [close, leading + parameter_format.open, *self.special_tokens]
        # Types as the parser reads them (`schema_types`: no `$ref` followed, as SGLang), so that a value
        # is written the way it will be read: a parameter typed only through `$ref` is text.
        types = schema_types(schema)
        defs = {k: root[k] for k in ("$defs", "definitions") if isinstance(root, Mapping) and k in root}
        if parameter_format.json_values or (types and "string" not in types):
            value = json_value({**schema, **defs} if isinstance(schema, Mapping) else schema)
        elif set(types) == {"string"}:
            value = self._verbatim_string(schema, excludes)
        else:  # untyped, or a union with string: the parser keeps any text as a string
            value = _free_text(excludes)
        return _tag(begin, value, close)

    @staticmethod
    def _verbatim_string(schema: Mapping[str, Any], excludes: list[str]) -> dict:
        """A string value written as is, honouring `const`, `enum`, `pattern` and the length bounds
        (not `format`). A length-bounded string is a character class without newlines and '<', so it
        can neither hold the closer nor a marker: free text excluding the closer cannot be bounded
        exactly (xgrammar's `max_chars` counts broken UTF-8 bytes as characters, and its lookaheads
        do not constrain)."""
        if isinstance(schema.get("const"), str):
            return _const(schema["const"])
        choices = [v for v in schema.get("enum") or () if isinstance(v, str)]
        if choices:
            return _one_of([_const(v) for v in choices])
        if isinstance(schema.get("pattern"), str):
            return {"type": "regex", "pattern": schema["pattern"].removeprefix("^").removesuffix("$")}
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if low or high is not None:
            return {"type": "grammar", "grammar": f"root ::= [^\\n<]{{{int(low)},{'' if high is None else int(high)}}}"}
        return _free_text(excludes)

    def _call(self, tool: Mapping[str, Any]) -> dict:
        """One call of `tool` without its closer."""
        call = self.chat_format.tool_call
        function = tool.get("function", tool)
        name, schema = function["name"], function.get("parameters") or {"type": "object", "properties": {}}
        if call.parameters is not None:
            return _sequence(_const(call.open.text + name + call.name_end), self._parameters(call.parameters, schema))
        object_schema = {
            "type": "object",
            "properties": {call.json.name_key: {"const": name},
                           call.json.arguments_key: {"type": "string"} if call.json.arguments_as_string else schema},
            "required": [call.json.name_key, call.json.arguments_key],
        }
        return _sequence(_const(call.open.rendered), json_value(object_schema))

    def _closers(self) -> tuple[str, str | None]:
        """(what ends the last call, what separates parallel calls or None). Beam: the `<|call|>` stop
        token, and `<|end|><|start|>assistant`."""
        call = self.chat_format.tool_call
        stops = set(self.chat_format.stop_tokens)
        final = next((m.text for m in call.close if m.text in stops), call.close[0].text)
        separator = next((m.text for m in call.close if m.text != final), None)
        return final, separator

    def _structural_tag(self, format_: dict, stop_tokens: Sequence[str]) -> Grammar:
        return Grammar(json.dumps({"type": "structural_tag", "format": format_}, sort_keys=True), tuple(stop_tokens))

    # -- the grammars -------------------------------------------------------------------------------
    def json_output(self, schema: Mapping[str, Any] | None = None, *, reasoning_tokens: int = 0) -> Grammar:
        """The answer is JSON matching `schema` (None: any object)."""
        chat = self.chat_format
        opener = _const(chat.content_open.text) if chat is not None and chat.content_open is not None else None
        return self._structural_tag(_sequence(self._reasoning(reasoning_tokens), opener, json_value(schema)),
                                    self.answer_stops)

    def forced_tool_calls(self, tools: Sequence[Mapping[str, Any]], *, name: str | None = None,
                          parallel: bool = True, reasoning_tokens: int = 0) -> Grammar:
        """The turn calls `name` (None: any of `tools`, at least once; more in parallel if allowed)."""
        if self.chat_format is None or self.chat_format.tool_call is None:
            raise ValueError("the chat template has no tool-call format to constrain")
        chosen = [t for t in tools if name is None or t.get("function", t).get("name") == name]
        if not chosen:
            raise ValueError(f"no tool named {name!r} among the tools")
        call = _one_of([self._call(t) for t in chosen])
        final, separator = self._closers()
        more = None
        if parallel and name is None and separator is not None:
            more = {"type": "star", "content": _sequence(_const(separator), call)}
        # A closer that is a stop token ends the grammar as its only allowed stop; another is text.
        if final in self.chat_format.stop_tokens:
            body, stops = _sequence(self._reasoning(reasoning_tokens), call, more), (final,)
        else:
            body, stops = _sequence(self._reasoning(reasoning_tokens), call, more, _const(final)), self.answer_stops
        return self._structural_tag(body, stops)

    def tool_calls_once_started(self, tools: Sequence[Mapping[str, Any]]) -> Grammar | None:
        """Free output; a call, once its opener appears, is one of `tools` with valid arguments.
        None where the format cannot express it (JSON calls: their opener is not followed by the name)."""
        call = self.chat_format.tool_call if self.chat_format else None
        if call is None or call.parameters is None or not tools:
            return None
        tags = []
        for tool in tools:
            function = tool.get("function", tool)
            schema = function.get("parameters") or {"type": "object", "properties": {}}
            arguments = self._parameters(call.parameters, schema) or _const("")
            tags.append(_tag(call.open.text + function["name"] + call.name_end, arguments,
                             [m.text for m in call.close]))
        triggered = {"type": "triggered_tags", "triggers": [call.open.text], "tags": tags}
        return self._structural_tag(triggered, ())


# ---- compiling and matching (tokenizer-bound) -----------------------------------------------------
def _vocab_type(tokenizer):
    import xgrammar

    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
    if "ByteLevel" in kinds:
        return xgrammar.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgrammar.VocabType.BYTE_FALLBACK
    return xgrammar.VocabType.RAW


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher, disallowed_stop_ids: Sequence[int]):
        self._matcher = matcher
        # Stop tokens of the engine that may not end this grammar: (word, mask keeping the other bits).
        self._cleared = [(t // 32, np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)) for t in disallowed_stop_ids]

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (int32, C-contiguous, on the host)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        words = bitmask[row].view(np.uint32)
        for word, keep in self._cleared:
            words[word] &= keep

    def accept(self, token_id: int) -> bool:
        """Advances over a sampled token; False (and no change) if the grammar does not allow it."""
        return self._matcher.accept_token(int(token_id))

    @property
    def terminated(self) -> bool:
        """It accepted a stop token: the output is complete."""
        return self._matcher.is_terminated()


class GrammarBackend:
    """Compiles `Grammar`s for one tokenizer (`tokenizers.Tokenizer`) and makes matchers.
    `vocab_size`: the model's logits width (may exceed the tokenizer's vocabulary); `stop_token_ids`:
    every token that ends generation in the engine."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], *, max_threads: int = 2):
        import xgrammar

        self._xgr = xgrammar
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(sorted(set(int(t) for t in stop_token_ids)))
        vocab = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.get_vocab_size())]
        info = xgrammar.TokenizerInfo(vocab, _vocab_type(tokenizer), vocab_size=vocab_size,
                                      stop_token_ids=list(self.stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=max_threads)

    @functools.cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The tokenizer's control tokens, as text."""
        return tuple(t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special)

    def _stop_ids(self, grammar: Grammar) -> tuple[int, ...]:
        ids = []
        for token in grammar.stop_tokens:
            token_id = self.tokenizer.token_to_id(token)
            if token_id not in self.stop_token_ids:
                raise ValueError(f"the grammar's stop token {token!r} does not end generation in this engine")
            ids.append(token_id)
        return tuple(ids) or self.stop_token_ids

    def compile(self, grammar: Grammar):
        """The compiled grammar (xgrammar caches it); ValueError if it cannot be compiled."""
        self._stop_ids(grammar)
        try:
            return self._compiler.compile_structural_tag(grammar.structural_tag)
        except Exception as error:  # noqa: BLE001 - xgrammar's errors are RuntimeErrors of its FFI
            raise ValueError(f"the output grammar cannot be compiled: {_message(error)}") from error

    def matcher(self, grammar: Grammar) -> Matcher:
        allowed = set(self._stop_ids(grammar))
        return Matcher(self._xgr.GrammarMatcher(self.compile(grammar)),
                       [t for t in self.stop_token_ids if t not in allowed])
