"""`AsyncEngine`: the engine driven by one background thread, for asyncio servers.

The thread steps the engine while it has work and sleeps otherwise. `generate` adds a request and
yields its `RequestOutput`s as the steps produce them; leaving the iterator early (a client that
disconnects, a cancelled task) aborts the request, which frees its pages. The engine itself is not
thread-safe, so every call into it holds one lock; a step holds it for its duration.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Sequence

from serving.engine import LLMEngine, RequestOutput
from serving.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's step failed; requests in flight were aborted."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.05):
        self.engine = engine
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._idle_wait_s = idle_wait_s
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="beam-engine", daemon=True)
        self._thread.start()

    async def generate(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt, params)  # ValueError on bad input
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._work.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped after an error: {item!r}") from item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def shutdown(self) -> None:
        self._stop.set()
        self._work.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                busy = self.engine.has_unfinished_requests()
            if not busy:
                self._work.wait(self._idle_wait_s)
                self._work.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
                    routes = [(out, self._streams.get(out.request_id)) for out in outputs]
                    for out in outputs:
                        if out.finished:
                            self._streams.pop(out.request_id, None)
            except Exception as error:  # noqa: BLE001 - every waiting client must hear of it
                log.exception("engine step failed")
                self._fail(error)
                return
            for out, route in routes:
                if route is not None:
                    loop, queue = route
                    loop.call_soon_threadsafe(queue.put_nowait, out)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        with self._lock:
            streams, self._streams = self._streams, {}
            for request_id in streams:
                self.engine.abort_request(request_id)
        for loop, queue in streams.values():
            loop.call_soon_threadsafe(queue.put_nowait, error)
