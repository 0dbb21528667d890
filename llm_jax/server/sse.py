"""Responses that notice a client going away: Server-Sent Events, and waiting on a whole response.

Starlette's ``StreamingResponse`` notices a closed connection only when its next write fails (ASGI 2.4
servers) — after the next token, or never for a request still queued. Here a task listens for the
server's ``http.disconnect`` beside the work and cancels it at once, so the engine requests behind it
are aborted and their KV-cache blocks freed while the client is still closing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.types import Receive, Scope, Send

CLIENT_CLOSED = 499  # nginx's status for a request whose client left; logged, never seen by anyone


class Disconnected(Exception):
    """The client closed the connection before the response was complete."""


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[Any]) -> Any:
    """``work``'s result, or :class:`Disconnected` (``work`` cancelled) when the client goes first."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this coroutine itself is cancelled (the server's shutdown grace ran out)
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise Disconnected
    return task.result()


class EventStream:
    """An ASGI response sending ``events`` (already ``data: ...`` formatted) as ``text/event-stream``.

    Cut short by the server (its shutdown grace ran out: the request's task is cancelled), it ends with
    ``cut_events`` instead. ``on_close`` runs once the stream ended, with the status to log: 200 when it
    completed (an error event included), ``CLIENT_CLOSED`` when the client left, 503 when cut short.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], *, headers: dict[str, str], cut_events: str,
                 on_close: Callable[[int], None]):
        self.events, self.headers, self.cut_events, self.on_close = events, headers, cut_events, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {"content-type": f"{self.media_type}; charset=utf-8", "cache-control": "no-cache",
                   "x-accel-buffering": "no", **self.headers}
        status = CLIENT_CLOSED

        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]})
            async for text in self.events:
                await send({"type": "http.response.body", "body": text.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await unless_disconnected(receive, pump())
            status = 200
        except (Disconnected, OSError):  # OSError: a write to a closed connection
            pass
        except asyncio.CancelledError:  # the server is stopping: say so, rather than cut the stream mid-event
            status = 503
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": self.cut_events.encode(), "more_body": False})
        finally:
            await self.events.aclose()
            self.on_close(status)
