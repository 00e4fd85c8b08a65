"""What a chat template says about the model's output: the markers around reasoning, the answer and
tool calls. `template_probe.learn_chat_format` fills these in from the template itself;
`parser.StreamingParser` compiles them into a streaming parser.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Marker:
    """Literal text that the template writes around a part of the message.

    `text` must appear exactly. Newlines the template puts right before or after it
    (`leading_newlines`, `trailing_newlines`) are layout: a parser consumes up to that many when
    present and does not require them, so `<think>\\nR\\n</think>` and `<think>R</think>` read alike.
    Spaces are never optional (Beam's ` to=` needs its space).
    """

    text: str
    leading_newlines: int = 0
    trailing_newlines: int = 0

    @classmethod
    def from_rendered(cls, rendered: str) -> Marker:
        core = rendered.strip("\n")
        if not core:
            raise ValueError(f"a marker needs text besides newlines, got {rendered!r}")
        return cls(core, len(rendered) - len(rendered.lstrip("\n")), len(rendered) - len(rendered.rstrip("\n")))

    @property
    def rendered(self) -> str:
        """The marker as the template writes it."""
        return "\n" * self.leading_newlines + self.text + "\n" * self.trailing_newlines

    def merged(self, other: Marker) -> Marker:
        """One marker for two renderings of the same text with different layout newlines."""
        assert self.text == other.text
        return Marker(self.text, max(self.leading_newlines, other.leading_newlines),
                      max(self.trailing_newlines, other.trailing_newlines))


def merge_markers(markers: list[Marker]) -> tuple[Marker, ...]:
    """Deduplicate by text (keeping first-seen order), widening the optional newlines."""
    by_text: dict[str, Marker] = {}
    for marker in markers:
        by_text[marker.text] = by_text[marker.text].merged(marker) if marker.text in by_text else marker
    return tuple(by_text.values())


@dataclass(frozen=True)
class ParameterFormat:
    """Arguments written one tag per argument, e.g. Beam's
    `<rfl:parameter name="city">\\nParis\\n</rfl:parameter>`: `open` + name + `name_end` + value + `close`,
    consecutive arguments joined by `separator`."""

    open: str  # '<rfl:parameter name="'
    name_end: str  # '">\n'
    close: str  # '\n</rfl:parameter>'
    separator: str  # '\n'
    # False: strings are written verbatim and other values as JSON (Beam), so a value is text unless
    # the tool's schema says otherwise. True: every value is JSON.
    json_values: bool


@dataclass(frozen=True)
class JsonCallFormat:
    """A call written as one JSON object, e.g. `{"name": "f", "arguments": {...}}`."""

    name_key: str
    arguments_key: str
    arguments_as_string: bool  # the template writes the arguments as a JSON string inside the object


@dataclass(frozen=True)
class ToolCallFormat:
    """How one tool call is written. Exactly one of `parameters` (the name follows `open` and ends at
    `name_end`, then tagged arguments) and `json` (`open`, a JSON object, a closer) is set."""

    open: Marker  # ' to=' / '<tool_call>'
    close: tuple[Marker, ...]  # '<|call|>', '<|end|><|start|>assistant' / '</tool_call>'
    name_end: str | None = None  # '<|channel|>analysis <|constrain|>xml<|message|>'
    parameters: ParameterFormat | None = None
    json: JsonCallFormat | None = None

    def __post_init__(self) -> None:
        if (self.parameters is None) == (self.json is None):
            raise ValueError("a tool call format has either tagged parameters or a JSON object")
        if self.parameters is not None and not self.name_end:
            raise ValueError("tagged parameters need the marker that ends the tool name")


@dataclass(frozen=True)
class ChatFormat:
    """The grammar of one assistant turn, as its chat template writes it.

    The output is a sequence of parts: reasoning (`reasoning_open` ... `reasoning_close`), the answer
    (`content_open` ... `content_close`; with `content_open` None the answer is any text outside the
    other parts) and tool calls. Text outside every part is dropped when the answer has an opener
    (Beam: the `<|start|>assistant` between messages). A stop token ends the output.
    """

    message_start: str  # the generation prompt's assistant header, e.g. '<|start|>assistant'
    reasoning_key: str | None  # the message field the template reads past reasoning from
    reasoning_open: Marker | None
    reasoning_close: tuple[Marker, ...]
    content_open: Marker | None
    content_close: tuple[Marker, ...]
    tool_call: ToolCallFormat | None
    stop_tokens: tuple[str, ...] = ()
