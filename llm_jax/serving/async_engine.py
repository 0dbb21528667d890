"""The engine's loop in a background thread, and per-request streams for asyncio code (a server).

    engine = AsyncEngine(Engine(model, ...))          # starts the loop
    async for out in engine.generate("a", "Once upon a time", max_new_tokens=64):
        ...                                           # RequestOutput s as steps produce them
    await engine.shutdown()

The thread owns the :class:`~llm_jax.serving.engine.Engine` (which is not thread-safe): requests and aborts
reach it through a queue and take effect between steps; each step's outputs go back to their streams'
event loops. A stream that is closed early (a client gone: the consumer stops iterating or is cancelled)
aborts its request, freeing its blocks at once. A request the engine refuses raises in ``generate``; a
step that fails ends the requests it ran with the error and leaves the others running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from llm_jax.serving.engine import Engine, RequestOutput, StepError


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue  # RequestOutput s, then None at the end or an exception


class AsyncEngine:
    """Runs ``engine`` step after step in a background thread while it has requests."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="llm_jax-engine", daemon=True)
        self._thread.start()

    async def generate(self, request_id: str, prompt, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Add a request (``Engine.add_request``'s arguments) and yield its outputs as they come."""
        if self._stopping.is_set():
            raise RuntimeError("the engine is shutting down")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop=loop, outputs=asyncio.Queue())
        if not self.is_running:
            raise RuntimeError("the engine's loop has stopped")
        added: Future = Future()
        self._commands.put(("add", request_id, prompt, kwargs, stream, added))
        finished = False
        try:
            await asyncio.wrap_future(added)  # the engine's refusal (ValueError) raises here
            while True:
                item = await stream.outputs.get()
                if item is None:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        except ValueError:
            finished = True  # refused: nothing to abort
            raise
        finally:
            if not finished:  # a consumer gone (closed or cancelled), even while the request was being added
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request between steps and free its blocks; its stream ends."""
        self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """``fn(engine)`` on the engine's thread, between steps (loading a LoRA adapter); its result, or
        its exception raised here."""
        if not self.is_running:
            raise RuntimeError("the engine's loop has stopped")
        done: Future = Future()
        self._commands.put(("call", fn, done))
        return await asyncio.wrap_future(done)

    @property
    def is_running(self) -> bool:
        """Whether the engine's loop is alive (it ends at shutdown, or if the loop itself failed)."""
        return self._thread.is_alive()

    @property
    def num_requests(self) -> int:
        """Requests running or waiting."""
        return len(self._streams)

    async def shutdown(self, timeout: float | None = None) -> None:
        """Stop taking requests, let the running ones finish (or abort them after ``timeout`` seconds),
        and stop the thread."""
        self._stopping.set()
        self._commands.put(("exit",))  # the loop ends once nothing is left to run
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._thread.join, timeout)
        if self._thread.is_alive():
            for request_id in list(self._streams):
                self.abort(request_id)
            await loop.run_in_executor(None, self._thread.join)

    # The engine's thread.
    def _loop(self) -> None:
        try:
            self._run_loop()
        except BaseException as error:  # the loop itself failed: no stream may wait forever
            for request_id in list(self._streams):
                self._deliver(request_id, RuntimeError(f"the engine's loop failed: {error!r}"))
            raise

    def _run_loop(self) -> None:
        exiting = False
        while True:
            idle = not self.engine.has_unfinished
            try:  # block for a command only when there is nothing to step
                command = self._commands.get(block=idle)
            except queue.Empty:
                command = None
            while command is not None:
                exiting |= self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if exiting and not self.engine.has_unfinished:
                return
            if self.engine.has_unfinished:
                self._step()

    def _apply(self, command: tuple) -> bool:
        match command:
            case ("add", request_id, prompt, kwargs, stream, added):
                try:
                    if request_id in self._streams:
                        raise ValueError(f"request {request_id!r} is already running")
                    self.engine.add_request(request_id, prompt, **kwargs)
                except Exception as error:  # refused: the caller hears why
                    added.set_exception(error)
                    return False
                self._streams[request_id] = stream
                added.set_result(None)
            case ("abort", request_id):
                self.engine.abort(request_id)
                self._deliver(request_id, None)
            case ("call", fn, done):
                try:
                    done.set_result(fn(self.engine))
                except Exception as error:
                    done.set_exception(error)
            case ("exit",):
                return True
        return False

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepError as error:  # the engine ended the requests this step ran; the others go on
            for request_id in set(self._streams) - {r.request_id for r in self.engine.scheduler.running} \
                    - {r.request_id for r in self.engine.scheduler.waiting}:
                self._deliver(request_id, RuntimeError(f"request {request_id} failed: {error}"))
            return
        for out in outputs:
            self._deliver(out.request_id, out)
            if out.finish_reason is not None:
                self._streams.pop(out.request_id, None)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id) if item is not None and not isinstance(item, BaseException) \
            else self._streams.pop(request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)
