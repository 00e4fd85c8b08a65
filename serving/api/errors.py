"""API errors and the two error body shapes (OpenAI's and Anthropic's)."""

from __future__ import annotations

# Anthropic's error `type` for each status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, *, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def openai_error(error: ApiError) -> dict:
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    if error.status == 401:
        kind = "authentication_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def anthropic_error(error: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(error.status, "api_error"), "message": error.message}}
