"""Worker health: a periodic GET /health per worker; routing sees only healthy ones."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp

log = logging.getLogger("sglang_hardened.lb")


@dataclass
class Worker:
    role: str  # "prefill" or "decode"
    url: str
    bootstrap_port: int | None = None
    healthy: bool = False

    async def check(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        try:
            async with session.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok != self.healthy:
            log.warning("%s %s is now %s", self.role, self.url, "healthy" if ok else "unhealthy")
        self.healthy = ok


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
