"""The project's small Beam tokenizer and chat template.

Beam's real tokenizer is not available, so beam-jax ships a byte-level BPE (8192 ids) with Beam's
control tokens and a Jinja template for Beam's Harmony-like chat format; `tools/build_tokenizer.py`
builds both into `assets/tokenizer/`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_DIR: Path = Path(__file__).parent / "assets" / "tokenizer"
CHAT_TEMPLATE_PATH: Path = TOKENIZER_DIR / "chat_template.jinja"

# Ids 0..15 in this order. The first eight and `<|mask|>` are referenced by Beam's parsers and
# drafter; the reserved ones keep room for more without moving any id.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",  # padding
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
    "<|mask|>",  # a speculative drafter's mask token
    *(f"<|reserved_{index}|>" for index in range(7)),
)
# Beam's parsers say the parameter closer is one (ordinary, non-special) token; ours is too.
PARAMETER_CLOSER_TOKEN = "\n</rfl:parameter>"
VOCAB_SIZE = 8192
# Generation stops after an answer (<|return|>) or a tool call (<|call|>).
STOP_TOKENS: tuple[str, ...] = ("<|return|>", "<|call|>")
REASONING_EFFORTS: tuple[str, ...] = ("low", "medium", "high")


def load_tokenizer(path: str | Path | None = None) -> tokenizers.Tokenizer:
    """Load `tokenizer.json` from `path` (a file or a directory; default: the shipped one)."""
    path = Path(path) if path is not None else TOKENIZER_DIR
    if path.is_dir():
        path = path / "tokenizer.json"
    return tokenizers.Tokenizer.from_file(str(path))


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Same as transformers' filter: plain JSON, unlike Jinja's HTML-escaping `tojson`.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _shipped_template() -> str:
    return CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # The environment transformers renders chat templates in, so both render the same text.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    return environment.from_string(template)


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None fields (as transformers does) and parse JSON-string tool-call arguments."""
    normalized = {key: value for key, value in message.items() if value is not None}
    if "tool_calls" in normalized:
        tool_calls = []
        for tool_call in normalized["tool_calls"]:
            tool_call = dict(tool_call)
            function = dict(tool_call.get("function", tool_call))
            if isinstance(function.get("arguments"), str):
                function["arguments"] = json.loads(function["arguments"] or "{}")
            if "function" in tool_call:
                tool_call["function"] = function
            else:
                tool_call = function
            tool_calls.append(tool_call)
        normalized["tool_calls"] = tool_calls
    return normalized


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str = "medium",
    add_generation_prompt: bool = True,
    template: str | None = None,
) -> str:
    """Render OpenAI-style `messages` (and `tools`) in Beam's chat format, without transformers.

    Tool-call arguments may be objects or JSON strings. Raises `jinja2.TemplateError` for an
    unknown role or an invalid `reasoning_effort`.
    """
    if template is None:
        template = _shipped_template()
    return _compile(template).render(
        messages=[_normalize_message(message) for message in messages],
        tools=list(tools) if tools is not None else None,
        reasoning_effort=reasoning_effort,
        add_generation_prompt=add_generation_prompt,
    )
