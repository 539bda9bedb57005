"""``--max-requests``: what a request holds, counted until the last of its work ends.

A client that hangs up ends its handler, but its worker calls and aborts run on, up to the
transfer grace (the lb never closes a call mid-transfer): counting handlers only let a tenant
that sends and hangs up in a loop keep any number of requests open on the workers. So a slot
is held until the handler and every task it started have ended; a request starts a fixed few
(its two calls, an abort, a deferred cancel), so the tasks are bounded with the slots.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine


class Slots:
    def __init__(self, limit: int):
        self.limit, self.open = limit, 0

    def take(self) -> Hold | None:
        """A slot for a new request, or None when ``limit`` are open."""
        if self.open >= self.limit:
            return None
        self.open += 1
        return Hold(self)


class Hold:
    """One request's slot and the tasks that keep it (held here too: the loop holds tasks weakly)."""

    def __init__(self, slots: Slots):
        self._slots: Slots | None = slots
        self._tasks: set[asyncio.Task] = set()
        self._handling = True

    def track(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def handler_done(self) -> None:
        self._handling = False
        self._release_if_idle()

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if self._slots is not None and not self._handling and not self._tasks:
            self._slots.open -= 1
            self._slots = None
