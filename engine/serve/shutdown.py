"""Graceful shutdown: SIGTERM or SIGINT drains the server instead of cutting its streams.

    GracefulServer(uvicorn_config(app, policy, ...), server, grace=10.0).run()

On the first signal (`handle_exit`, uvicorn's signal handler):
1. nothing more is admitted: a request gets 503 `shutting_down` with Retry-After, queued requests
   too (they have no row yet), and /health answers 503 (a load balancer stops sending here);
2. the running streams and requests (prefilling or decoding) go on, for up to `grace` seconds;
3. then the scheduler stops: each stream still open gets an `error` event (503 shutting_down) and
   `data: [DONE]`, each non-streaming request a 503;
4. once those answers are out (1 s at most) uvicorn shuts down as usual (listeners closed, idle
   connections closed, the lifespan's end).
The process is gone within grace + 2 s whatever happens (`hard_exit`: a timer that ends it with
os._exit should a step or a client hold it), and a second signal ends it at once.

uvicorn alone stopped accepting and then waited for every connection to close (a non-streaming
request decoding 10^12 tokens held the process forever, a second SIGTERM was ignored), while
sse-starlette cut every stream mid-event on the first signal: no error, no [DONE]. Its shutdown
watcher reads this server's `should_exit`, which is set only at step 4, when the streams have ended.
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import uvicorn

DEFAULT_GRACE_S = 10.0
POLL_S = 0.05       # how often the drain looks whether the running jobs are done
ANSWERS_S = 1.0     # how long the drain waits for the final answers to be written
HARD_EXIT_S = 1.8   # past the grace: the process ends whatever holds it


class GracefulServer(uvicorn.Server):
    """uvicorn's Server draining `server` (engine.serve.Server) on the first SIGTERM/SIGINT.
    grace: seconds running jobs may take to finish. hard_exit: end the process (os._exit) if it is
    still there HARD_EXIT_S after the grace, and at once on a second signal (False in tests that
    run the server in a thread of their own process)."""

    def __init__(self, config: uvicorn.Config, server, grace: float = DEFAULT_GRACE_S, hard_exit: bool = True,
                 on_exit=None):
        """on_exit: called once served, before uvicorn raises the signal again (which ends the process)."""
        super().__init__(config)
        self.on_exit = on_exit
        if not 0 <= grace < float("inf"):
            raise ValueError(f"grace must be a number of seconds >= 0, got {grace}")
        self.gen_server, self.grace, self.hard_exit = server, grace, hard_exit
        self.draining_since: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        with self.capture_signals():   # uvicorn's serve(), with on_exit before the signal is raised again
            await self._serve(sockets)
            if self.on_exit is not None:
                self.on_exit()

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (the main thread, between two of the event loop's steps)."""
        if self.draining_since is not None:   # a second signal: now
            if self.hard_exit:
                print(f"gen serve: signal {sig} again: exiting now", file=sys.stderr, flush=True)
                os._exit(128 + sig)
            self.force_exit = self.should_exit = True
            return
        self._captured_signals.append(sig)   # uvicorn raises it again once served (the usual exit status)
        self.draining_since = time.monotonic()
        if self.hard_exit:
            timer = threading.Timer(self.grace + HARD_EXIT_S, self._exit_now, args=(sig,))
            timer.daemon = True
            timer.start()
        if self._loop is None or not self.started:   # still starting: nothing is running yet
            self.should_exit = True
            return
        print(f"gen serve: shutting down: no new requests; running ones have {self.grace:g} s to finish",
              file=sys.stderr, flush=True)
        self.begin()

    def begin(self) -> None:
        """What the first signal does, callable from any thread (tests): start the drain."""
        self.draining_since = self.draining_since or time.monotonic()
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.drain()))

    async def drain(self) -> None:
        server, loop = self.gen_server, asyncio.get_running_loop()
        scheduler = server.scheduler
        scheduler.drain()
        deadline = self.draining_since + self.grace
        while scheduler.busy and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        await loop.run_in_executor(None, scheduler.stop, 1.0)   # the rest get their 503 / error event
        until = time.monotonic() + ANSWERS_S
        while self.server_state.tasks and time.monotonic() < until:   # the answers going out
            await asyncio.sleep(POLL_S)
        self.should_exit = True

    @staticmethod
    def _exit_now(sig: int) -> None:
        print("gen serve: the shutdown did not finish in time: exiting now", file=sys.stderr, flush=True)
        os._exit(128 + sig)


__all__ = ["GracefulServer", "DEFAULT_GRACE_S"]
