"""Request bodies of the OpenAI and Anthropic APIs (pydantic), validated strictly enough that bad
input becomes a 400 with the field named, and lenient where clients send extras we ignore."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serving.sampling import MAX_LOGPROBS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

MAX_N = 16
MAX_STOP = 16


class _Lenient(BaseModel):
    # Unknown fields are ignored (clients and SDKs send many), wrong types of known fields are not.
    model_config = ConfigDict(extra="ignore")


def _check_unicode(value: Any) -> None:
    """JSON can carry lone surrogates (`"\\ud800"`), which are not text: no tokenizer or grammar
    engine takes them, so they are refused here, with a 400, wherever they are in the body."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as error:
                    raise ValueError(f"strings must be valid Unicode ({error.reason}: {item[error.start]!r})") from None
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item


class _Request(_Lenient):
    """A whole request body."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        _check_unicode(data)
        return data


def _need_str(block: dict[str, Any], key: str, what: str) -> None:
    if not isinstance(block.get(key), str):
        raise ValueError(f"{what} needs a string `{key}`")


def _check_text_blocks(blocks: list[dict[str, Any]], what: str) -> None:
    """Content parts (OpenAI) or blocks (Anthropic): a string `type`, and a string `text` in text ones."""
    for block in blocks:
        if not isinstance(block, dict):
            raise ValueError(f"each {what} must be an object")
        _need_str(block, "type", f"each {what}")
        if block["type"] in ("text", "input_text"):
            _need_str(block, "text", f"a text {what}")


class ToolFunction(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    @field_validator("parameters")
    @classmethod
    def _schema_object(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type", "object") != "object":
            raise ValueError("tool parameters must be a JSON schema of type 'object'")
        if not isinstance(value.get("properties", {}), dict):
            raise ValueError("tool parameters 'properties' must be an object")
        return value


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: ToolFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingFields(_Request):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # SamplingParams' bounds (logits divided or multiplied by it stay finite in float32), in the schema.
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP} non-empty strings")
        return stops


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _parts(cls, value):
        if isinstance(value, list):
            _check_text_blocks(value, "content part")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, value):
        for call in value or ():
            function = call.get("function", call)
            if not isinstance(function, dict):
                raise ValueError("a tool call's `function` must be an object")
            _need_str(function, "name", "a tool call's function")
            if not isinstance(function.get("arguments", {}), (str, dict)):
                raise ValueError("a tool call's `arguments` must be a JSON string or an object")
        return value


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _limits(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if isinstance(self.tool_choice, dict):
            name = (self.tool_choice.get("function") or {}).get("name")
            if not name or not any(t.function.name == name for t in self.tools or []):
                raise ValueError("tool_choice names a function that is not in tools")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if self.response_format is not None:
            kind = self.response_format.get("type")
            if kind not in ("text", "json_object", "json_schema"):
                raise ValueError("response_format.type must be text, json_object or json_schema")
            spec = self.response_format.get("json_schema")
            if kind == "json_schema" and not (isinstance(spec, dict) and isinstance(spec.get("schema", {}), (dict, bool))):
                raise ValueError("response_format.json_schema must be an object whose `schema` is a JSON schema")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("batched string prompts are not supported: send one prompt per request")
            return value[0]
        return value


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]

    @field_validator("content")
    @classmethod
    def _blocks(cls, value):
        if isinstance(value, str):
            return value
        _check_text_blocks(value, "content block")
        for block in value:
            kind = block["type"]
            if kind == "thinking":
                _need_str(block, "thinking", "a thinking block")
            elif kind == "tool_use":
                _need_str(block, "name", "a tool_use block")
                if not isinstance(block.get("input", {}), dict):
                    raise ValueError("a tool_use block's `input` must be an object")
            elif kind == "tool_result":
                content = block.get("content", "")
                if not isinstance(content, str):
                    if not isinstance(content, list):
                        raise ValueError("a tool_result block's `content` must be a string or a list of blocks")
                    _check_text_blocks(content, "tool_result content block")
        return value


class AnthropicTool(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]


class MessagesRequest(_Request):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("system")
    @classmethod
    def _system(cls, value):
        if isinstance(value, list):
            _check_text_blocks(value, "system block")
        return value

    @model_validator(mode="after")
    def _tool_choice(self):
        if self.tool_choice is None:
            return self
        kind = self.tool_choice.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise ValueError("tool_choice.type must be auto, any, tool or none")
        if kind in ("any", "tool") and not self.tools:
            raise ValueError(f"tool_choice {kind} needs tools")
        if kind == "tool" and not any(t.name == self.tool_choice.get("name") for t in self.tools):
            raise ValueError("tool_choice names a tool that is not in tools")
        return self
