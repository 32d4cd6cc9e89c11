"""The engine's blocking RequestStreams, bridged into asyncio.

One HTTP request may be several engine requests (`n` > 1, a list of prompts); their events merge
into one asyncio.Queue in the order they happen. Each engine request is pumped by one task of a
bounded thread pool (one thread per request for its life, never one per token), which hands
events to the event loop with `call_soon_threadsafe`. The pool is sized to what the engine can
hold at once (running + waiting), so a pump never waits for a thread behind a finished request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import AsyncIterator

from jaxllm.engine.core import RequestOutput
from serve.http.engine_adapter import RequestStream


class StreamGroup:
    """Engine requests of one HTTP request: `events()` yields (index, RequestOutput) until every one has
    finished."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor):
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._streams: list[RequestStream] = []
        self._open = 0

    def add(self, index: int, stream: RequestStream) -> None:
        self._streams.append(stream)
        self._open += 1
        self._pool.submit(self._pump, index, stream)

    def _pump(self, index: int, stream: RequestStream) -> None:  # a pool thread
        for event in stream:  # ends after the final event, which every accepted request gets
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, event))
            except RuntimeError:  # the loop is closed (server stopped): nobody is listening
                stream.cancel()
                return

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._open:
            index, event = await self._queue.get()
            if event.finish_reason is not None:
                self._open -= 1
            yield index, event

    def cancel(self) -> None:
        """Cancel every engine request still running: the engine frees their rBlocks before its next step."""
        for stream in self._streams:
            stream.cancel()  # a no-op for one that has finished
