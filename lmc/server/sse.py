"""Server-sent events: the SSE response over engine streams (OpenAI's and SGLang's `data: {...}` events, ended by
`data: [DONE]`), interleaving several streams, and awaiting engine work unless the client hangs up.

However a streamed response ends (done, failed, or the client hung up), its engine streams are closed at once,
which aborts what is still running.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from .errors import ClientGone
from .protocol import ApiError, error_body
from .service import EngineStream, Service

log = logging.getLogger(__name__)


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def merge(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """Interleave several chunk streams as (index, chunk). Closing or cancelling the consumer cancels every
    producer and waits for them, so the streams can be closed right after."""
    if len(streams) == 1:
        async for c in streams[0]:
            yield 0, c
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, s):
        try:
            async for c in s:
                await q.put((i, c))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    left = len(tasks)
    try:
        while left:
            i, c = await q.get()
            if c is done:
                left -= 1
            elif isinstance(c, BaseException):
                raise c
            else:
                yield i, c
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)



async def start_streams(svc: Service, items, program=None) -> list[EngineStream]:
    """One engine stream per item, all submitted at once. Returns when each has its first chunk, so a refused
    request raises ApiError before any byte is sent (the others are then closed, which aborts them)."""
    svc.admit(len(items))
    try:
        started = await asyncio.gather(*(svc.stream(ids, p, program) for ids, p in items), return_exceptions=True)
    except BaseException:  # this handler was cancelled, and the engine streams with it (which aborted them)
        svc.pending -= len(items)
        raise
    failed = [s for s in started if isinstance(s, BaseException)]
    if failed:
        svc.pending -= len(failed)
        await close_streams([s for s in started if not isinstance(s, BaseException)])
        raise failed[0]
    return started


async def close_streams(streams) -> None:
    for s in streams:
        try:
            await s.aclose()
        except Exception:  # noqa: BLE001 - closing is best effort; the engine stream aborts itself when collected
            pass


class EventStream(StreamingResponse):
    """The SSE response over engine streams: `events(merged)` turns their interleaved (index, chunk) pairs into
    events; an error becomes an error event, and `data: [DONE]` ends the body. However the response ends (done,
    failed, or the client hung up), the streams are closed at once, which aborts what is still running. (Starlette
    leaves the body suspended when the client disconnects: it would be closed only when garbage-collected.)"""

    def __init__(self, streams: list[EngineStream], events):
        self.streams = streams
        super().__init__(self._body(events), media_type="text/event-stream")

    async def _body(self, events):
        merged = merge(self.streams)
        out = events(merged)
        try:
            async for event in out:
                yield event
        except ApiError as e:
            yield sse(error_body(e.status, e.message, e.type))
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
            log.exception("a streamed request failed")
            yield sse(error_body(500, f"{type(e).__name__}: {e}", "server_error"))
        finally:
            await out.aclose()
            await merged.aclose()
        yield b"data: [DONE]\n\n"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await close_streams(self.streams)


async def disconnected(request: Request) -> None:
    """Returns when the client hangs up. The request body has been read, so the next ASGI message it can get is the
    disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work):
    """Await `work` (engine requests), unless the client hangs up first: then `work` is cancelled, which aborts its
    requests so that decoding stops, and ClientGone is raised."""
    task = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait([task, hangup], return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not task.done():  # the client is gone, or this handler was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task not in done:
        raise ClientGone()
    return task.result()

