"""Request bodies of the OpenAI and Anthropic APIs (pydantic), validated strictly enough that bad
input becomes a 400 with the field named, and lenient where clients send extras we ignore."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serving.sampling import MAX_LOGPROBS

MAX_N = 16
MAX_STOP = 16


class _Lenient(BaseModel):
    # Unknown fields are ignored (clients and SDKs send many), wrong types of known fields are not.
    model_config = ConfigDict(extra="ignore")


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


class _SamplingFields(_Lenient):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
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


class AnthropicTool(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]


class MessagesRequest(_Lenient):
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
