"""A real uvicorn server on 127.0.0.1 around fp32 beam-tiny, for the HTTP tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import jax.numpy as jnp
import uvicorn

import beam_jax
from serving.api.app import build_app
from serving.async_engine import AsyncEngine
from serving.engine import EngineConfig, LLMEngine


@contextlib.contextmanager
def live_server(config: EngineConfig, *, seed: int, model: str, api_key: str) -> Iterator[tuple[str, AsyncEngine]]:
    """Yields (base URL, the server's AsyncEngine); stops both on exit."""
    engine = LLMEngine(beam_jax.load("beam-tiny", dtype=jnp.float32, seed=seed), config=config)
    engine.warmup()
    async_engine = AsyncEngine(engine)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(build_app(async_engine, served_model_name=model, api_key=api_key),
                                       host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    for _ in range(100):
        if uv.started:
            break
        time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}", async_engine
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        async_engine.shutdown()


def pool_is_free(async_engine: AsyncEngine, *, wait_s: float = 20.0) -> bool:
    """Whether, once the last requests finish (waiting up to `wait_s`), every KV page is back in the
    pool after the prefix cache lets go of its pages."""
    deadline = time.monotonic() + wait_s
    while True:
        with async_engine._lock:
            engine = async_engine.engine
            if not engine.has_unfinished_requests():
                engine.prefix_cache.reset()
                engine.pool.check_invariants()
                return engine.pool.num_free == engine.pool.num_pages
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
