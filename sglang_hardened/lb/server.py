"""The LB's HTTP side: checks, routing, relaying, and drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from concurrent.futures.process import BrokenProcessPool

import aiohttp
from aiohttp import web

from .config import LbConfig
from .exchange import Answer, Exchange, Stream, slices
from .offload import Offload
from .protocol import ROUTES, BadRequest, forwarded, read_body
from .routing import RoutingPolicy, load_policy, reads_payload
from .slots import Hold, Slots
from .workers import Pool, Worker

log = logging.getLogger("sglang_hardened.lb")
READ_BUFSIZE = 2 ** 21  # a first streamed event with logprobs can exceed aiohttp's 64 KiB default


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class Balancer:
    def __init__(self, config: LbConfig, policy: RoutingPolicy):
        self.config, self.policy = config, policy
        self.pool = Pool([Worker("prefill", p.url.rstrip("/"), p.bootstrap_port) for p in config.prefill],
                         [Worker("decode", url.rstrip("/")) for url in config.decode], config.health_interval_s)
        self.session: aiohttp.ClientSession | None = None
        self.slots = Slots(config.max_requests)
        self.offload = Offload()
        self.draining = False

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        for route in ROUTES:
            app.router.add_post(f"/{route}", self._handler(route))
        app.router.add_get("/health", self.health)
        return app

    async def health(self, _request: web.Request) -> web.Response:
        if self.draining:
            return _error(503, "draining")
        if not (self.pool.healthy("prefill") and self.pool.healthy("decode")):
            return _error(503, "no healthy prefill or decode worker")
        return web.Response(text="ok")

    def _handler(self, route: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            hold = self.slots.take()
            if hold is None:
                return _error(503, f"{self.config.max_requests} requests open (each until its worker calls "
                                   "and aborts end), the --max-requests limit")
            try:
                return await self.forward(route, request, hold)
            except BrokenProcessPool:
                return _error(503, "a JSON worker process of the lb died (logged); try again")
            finally:
                hold.handler_done()
        return handle

    async def forward(self, route: str, request: web.Request, hold: Hold) -> web.StreamResponse:
        if self.draining:
            return _error(503, "the load balancer is shutting down")
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                raw = await request.read()
            client = await self.offload.run(len(raw), read_body, route, raw, reads_payload(self.policy))
        except TimeoutError:
            return _error(408, f"request body not received within {self.config.body_timeout_s:g} s")
        except web.HTTPException as exc:  # e.g. 413 over --max-body-bytes
            return _error(exc.status, exc.reason)
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        prefill, decode = self.pool.healthy("prefill"), self.pool.healthy("decode")
        if not prefill or not decode:
            return _error(503, "no healthy prefill or decode worker")
        p, d = self.policy.choose(prefill, decode, client.payload)
        ex = Exchange(self.session, route, forwarded(client, p), p, d, hold.track, self.config.max_answer_bytes,
                      self.offload)
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                result = await ex.outcome()
        except TimeoutError:
            hold.track(ex.cancel_safely(self.config.transfer_grace_s))
            return _error(504, f"no answer within {self.config.request_timeout_s:g} s")
        except asyncio.CancelledError:  # the client went away
            hold.track(ex.cancel_safely(self.config.transfer_grace_s))
            raise
        if isinstance(result, Answer):
            return await _send(request, result)
        return await self._relay(request, ex, hold, result)

    async def _relay(self, request: web.Request, ex: Exchange, hold: Hold, stream: Stream) -> web.StreamResponse:
        """Pipe decode's stream; a client gone mid-stream has decode aborted at once (the send is over)."""
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await reply.prepare(request)
            await reply.write(stream.first)
            async for chunk in stream.response.content.iter_any():
                await reply.write(chunk)
            await reply.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            hold.track(ex.cancel_safely(self.config.transfer_grace_s))
            raise
        finally:
            stream.response.release()
        return reply

    async def drain(self, timeout_s: float) -> None:
        """Let requests being handled, and their worker calls and aborts, end (up to ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while self.slots.open and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.slots.open:
            log.warning("drain: %d requests still open after %.0f s; exiting", self.slots.open, timeout_s)


async def _send(request: web.Request, answer: Answer) -> web.StreamResponse:
    """A whole answer in slices: written at once, a large one holds the loop while it is copied."""
    reply = web.StreamResponse(status=answer.status, headers={"Content-Type": answer.content_type})
    reply.content_length = len(answer.body)
    await reply.prepare(request)
    async for piece in slices((answer.body,)):
        await reply.write(piece)
    await reply.write_eof()
    return reply


async def serve(config: LbConfig) -> None:
    """Run until SIGTERM or SIGINT, then stop listening, drain, and return."""
    config.validate()
    balancer = Balancer(config, load_policy(config.policy))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)  # our own deadlines, never a socket close
    async with aiohttp.ClientSession(timeout=timeout, read_bufsize=READ_BUFSIZE,
                                     connector=aiohttp.TCPConnector(limit=config.max_connections)) as session:
        balancer.session = session
        await asyncio.gather(balancer.pool.check_all(session), balancer.offload.start())
        health = asyncio.create_task(balancer.pool.run(session))
        runner = web.AppRunner(balancer.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("sglang-hardened lb on http://%s:%d: %s", config.host, config.port,
                 json.dumps({"prefill": [w.url for w in balancer.pool.prefill],
                             "decode": [w.url for w in balancer.pool.decode], "policy": config.policy}))
        await stop.wait()
        log.info("draining: no new requests; waiting up to %.0f s for open ones", config.drain_timeout_s)
        balancer.draining = True
        await site.stop()
        await balancer.drain(config.drain_timeout_s)
        health.cancel()
        balancer.offload.close()
        await runner.cleanup()
