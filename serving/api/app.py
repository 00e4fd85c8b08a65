"""The HTTP server: OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) and Anthropic
(`/v1/messages`) APIs on one `AsyncEngine`, plus `/health` and Prometheus `/metrics`.

Chat requests are rendered with the model's chat template; the generated text (special tokens
kept) goes through the streaming parser compiled from that template, which splits it into
reasoning, answer text and tool calls. Errors are 4xx bodies shaped as each API shapes them; a
client that disconnects mid-stream aborts its request (the engine frees its pages).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api import anthropic_api, openai_api
from serving.api.common import Server
from serving.api.errors import ApiError, anthropic_error, openai_error
from serving.async_engine import AsyncEngine


def build_app(engine: AsyncEngine, *, served_model_name: str = "beam-tiny", api_key: str | None = None) -> FastAPI:
    server = Server(engine, served_model_name=served_model_name, api_key=api_key)
    app = FastAPI(title="beam-jax", version="0.1.0")
    app.state.server = server

    def error_response(request: Request, error: ApiError) -> JSONResponse:
        shape = anthropic_error if request.url.path.startswith("/v1/messages") else openai_error
        return JSONResponse(shape(error), status_code=error.status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError):
        return error_response(request, error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError):
        problems = error.errors()
        first = problems[0] if problems else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in problems)
        code = "json_invalid" if first.get("type") == "json_invalid" else "invalid_request_error"
        return error_response(request, ApiError(400, message or "invalid request", code, param=where))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        return error_response(request, ApiError(error.status_code, str(error.detail), "not_found"))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, error: Exception):
        # A bug, not bad input (uvicorn logs the traceback): still a body the client's SDK can read.
        return error_response(request, ApiError(500, f"internal error: {type(error).__name__}", "server_error"))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if server.api_key and request.url.path != "/health":
            bearer = request.headers.get("authorization", "")
            given = bearer[7:] if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key")
            if given != server.api_key:
                return error_response(request, ApiError(401, "Invalid or missing API key.", "invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        if server.engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(server.engine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "beam-jax", "max_model_len": server.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(server.engine.stats()), media_type="text/plain; version=0.0.4")

    openai_api.add_routes(app, server)
    anthropic_api.add_routes(app, server)
    return app
