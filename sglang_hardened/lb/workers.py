"""Worker health: a periodic GET /health per worker; routing sees only healthy ones.

A worker that turns healthy is also asked whether it is a hardened build (its
/server_info's ``hardening`` field): the lb aborts decode once prefill has
answered, taking the answer as the end of the KV send, and only a hardened
prefill answers after a failed send has stopped writing (H5), and only a
hardened decode holds the pages of a request it aborts until then. The lb
serves either way, and says so in its log.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp

from ..runtime.identity import INFO_ROUTES

log = logging.getLogger("sglang_hardened.lb")


@dataclass
class Worker:
    role: str  # "prefill" or "decode"
    url: str
    bootstrap_port: int | None = None
    healthy: bool = False
    hardened: bool | None = None  # None: not asked since it last turned healthy

    async def check(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with session.get(f"{self.url}/health", timeout=timeout) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok != self.healthy:
            log.warning("%s %s is now %s", self.role, self.url, "healthy" if ok else "unhealthy")
            self.hardened = None  # a restart may have changed the build
        self.healthy = ok
        if ok and self.hardened is None:
            self.hardened = await self._is_hardened(session, timeout)
            if not self.hardened:
                log.warning("%s %s is not a hardened SGLang build: after a failed KV send its answer does "
                            "not mean its writes into decode's pages stopped, so aborting decode then (as "
                            "the lb does) is safe only with hardened servers on both roles (H5, H9)",
                            self.role, self.url)

    async def _is_hardened(self, session: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout) -> bool:
        for route in INFO_ROUTES:
            try:
                async with session.get(f"{self.url}{route}", timeout=timeout) as r:
                    if r.status == 200:
                        info = await r.json(content_type=None)
                        return isinstance(info, dict) and info.get("hardening", {}).get("hardened") is True
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
                pass
        return False


class Pool:
    """Every worker of both roles, checked together every ``interval_s``."""

    def __init__(self, prefill: list[Worker], decode: list[Worker], interval_s: float):
        self.prefill, self.decode, self.interval_s = prefill, decode, interval_s

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(w.check(session, self.interval_s) for w in self.prefill + self.decode))

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_all(session)

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in (self.prefill if role == "prefill" else self.decode) if w.healthy]
