"""JSON work on client- and worker-sized data, kept off the event loop every tenant's stream shares.

json holds the GIL while it parses or writes, so in a thread it stalls the loop all the same
(13 MiB of token ids: as long as inline); a large body's parse and its one serialisation, and
a large logprob merge, run in a few worker processes instead, which take and give bytes (this
process copies them, never parses them). Work up to ``INLINE_JSON_BYTES`` runs inline.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from .config import INLINE_JSON_BYTES, JSON_PROCESSES

log = logging.getLogger("sglang_hardened.lb")
T = TypeVar("T")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Offload:
    """``JSON_PROCESSES`` worker processes, started fresh (spawn: never a fork of a threaded
    loop); a pool whose process died is replaced for the next request."""

    def __init__(self) -> None:
        self._pool = _new_pool()

    async def start(self) -> None:
        """Start every process now, with the lb, not in a step of the loop a request waits on."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._pool, int) for _ in range(JSON_PROCESSES)))

    async def run(self, size: int, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``, in a worker process when ``size`` (bytes of JSON) is over the inline limit.
        BrokenProcessPool if the process died (killed for memory, say)."""
        if size <= INLINE_JSON_BYTES:
            return fn(*args)
        pool = self._pool
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except BrokenProcessPool:
            if self._pool is pool:
                log.warning("a JSON worker process of the lb died; starting new ones")
                self._pool = _new_pool()
                pool.shutdown(wait=False, cancel_futures=True)
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _new_pool() -> ProcessPoolExecutor:
    return ProcessPoolExecutor(JSON_PROCESSES, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_end_with_parent, initargs=(os.getpid(),))


def _end_with_parent(parent: int) -> None:
    """Each process ends with the lb, even one killed outright: the handles of its own queue
    keep it waiting otherwise (and the lb's stdout open, which a supervisor reads to its end)."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # Linux, as SGLang's servers
    if os.getppid() != parent:  # the lb was gone before the line above
        os._exit(1)
