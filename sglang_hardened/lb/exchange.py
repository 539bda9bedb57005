"""One client request's pair of worker calls, and when each may be cancelled.

Closing a worker connection makes SGLang abort the request on that worker at
once, whatever its transfer is doing; so the LB never closes one early. It
cancels with POST /abort_request {"rid"} instead, and only when no write
into decode's pages can still land:

- The LB cannot see when prefill starts sending KV. It knows the send is
  over when prefill has answered (prefill answers after its send succeeded
  or failed, or after rejecting the request before sending) or when decode
  has produced output (decode emits nothing before its KV arrived).
- A request rejected by either role: the client gets that first non-2xx
  answer with its body; if prefill rejected, decode is aborted at once.
- A client that disconnects, or a request past its timeout: if the send is
  over, decode is aborted at once; otherwise the LB waits (``grace_s``) for
  prefill to answer or decode to produce output, then aborts decode, and
  prefill too if it still has not answered. A request not yet dispatched
  reaches neither role.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from .offload import Offload
from .protocol import Forwarded, merge_logprobs
from .workers import Worker

log = logging.getLogger("sglang_hardened.lb")
ABORT_TIMEOUT_S = 10.0
SSE_END = b"\n\n"
WRITE_SLICE = 2 ** 20  # a body goes out in slices: no step of the event loop copies more of it


@dataclass(frozen=True)
class Answer:
    """A worker's whole answer, or the LB's own error in the same shape."""

    status: int
    body: bytes
    content_type: str = "application/json"

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @classmethod
    def error(cls, status: int, message: str) -> Answer:
        return cls(status, json.dumps({"error": {"message": message, "code": status}}).encode())


@dataclass
class Stream:
    """Decode's streaming answer once it produced its first event (so the send is over)."""

    response: aiohttp.ClientResponse
    first: bytes


def sse_error(event: bytes) -> Answer | None:
    """SGLang fails a streaming request as HTTP 200 whose first event is {"error": {…, "code"}}."""
    text = event.strip()
    if not text.startswith(b"data:"):
        return None
    try:
        data = json.loads(text[5:])
    except ValueError:
        return None
    if not (isinstance(data, dict) and isinstance(data.get("error"), dict)):
        return None
    code = data["error"].get("code")
    return Answer(code if isinstance(code, int) and 400 <= code < 600 else 500, json.dumps(data).encode())


class AnswerTooLarge(Exception):
    """A worker's answer is over the lb's limit."""


async def _read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or AnswerTooLarge once it passes ``limit`` bytes (memory stays bounded)."""
    body = bytearray()
    async for chunk in response.content.iter_chunked(2 ** 16):
        body += chunk
        if len(body) > limit:
            raise AnswerTooLarge(f"over {limit} bytes")
    return bytes(body)


async def _read_answer(response: aiohttp.ClientResponse, stream: bool, limit: int) -> Answer:
    body = await _read_capped(response, limit)
    if stream and response.status < 300:
        return sse_error(body.split(SSE_END, 1)[0]) or Answer(response.status, body, response.content_type)
    return Answer(response.status, body, response.content_type)


async def slices(parts: tuple[bytes, ...]) -> AsyncIterator[memoryview]:
    """``parts`` in slices of WRITE_SLICE, without copying them."""
    for part in parts:
        view = memoryview(part)
        for start in range(0, len(view), WRITE_SLICE):
            yield view[start:start + WRITE_SLICE]


class Exchange:
    """Both worker calls of one request; their tasks outlive the client's connection."""

    def __init__(self, session: aiohttp.ClientSession, route: str, fwd: Forwarded, prefill: Worker,
                 decode: Worker, track: Callable[[Coroutine], asyncio.Task], max_answer_bytes: int,
                 offload: Offload):
        self.session, self.route, self.fwd, self.stream = session, route, fwd, fwd.stream
        self.max_answer_bytes, self.offload = max_answer_bytes, offload
        self.prefill, self.decode, self._track = prefill, decode, track
        self.stream_response: aiohttp.ClientResponse | None = None
        self.prefill_task: asyncio.Task[Answer] = track(self._call_prefill())
        self.decode_task: asyncio.Task[Answer | Stream] = track(self._call_decode())

    async def _post(self, worker: Worker) -> aiohttp.ClientResponse:
        return await self.session.post(f"{worker.url}/{self.route}", data=slices(self.fwd.parts),
                                       headers={"Content-Type": "application/json",
                                                "Content-Length": str(self.fwd.size)})

    def _failed(self, worker: Worker, what: str, exc: Exception) -> Answer:
        """The client's 502 names the role only; the worker's address and the cause go to the log."""
        log.warning("request %s: %s %s %s: %s", self.fwd.rids[0], worker.role, worker.url, what, exc)
        return Answer.error(502, f"{worker.role} {what}")

    async def _call_prefill(self) -> Answer:
        try:
            async with await self._post(self.prefill) as response:
                return await _read_answer(response, self.stream, self.max_answer_bytes)
        except aiohttp.ClientError as exc:
            return self._failed(self.prefill, "did not answer", exc)
        except AnswerTooLarge as exc:
            return self._failed(self.prefill, "answered more than the lb takes", exc)

    async def _call_decode(self) -> Answer | Stream:
        response = None
        try:
            response = await self._post(self.decode)
            if not self.stream or response.status >= 300:
                async with response:
                    return await _read_answer(response, self.stream, self.max_answer_bytes)
            self.stream_response = response
            first = await response.content.readuntil(SSE_END)
            failed = sse_error(first)
            if failed:
                await _read_capped(response, self.max_answer_bytes)  # to its end: the worker closes it, not us
                response.release()
                return failed
            return Stream(response, first)
        except aiohttp.ClientError as exc:
            return self._failed(self.decode, "did not answer", exc)
        except (AnswerTooLarge, ValueError, HttpProcessingError) as exc:  # a first event over the line limit
            # decode has answered, so its send is over: end the request there
            if response is not None:
                response.close()
            self._track(self.abort(self.decode))
            return self._failed(self.decode, "answered more than the lb takes", exc)

    def send_over(self) -> bool:
        """True once no KV write for this request can still be under way."""
        if self.prefill_task.done():
            return True
        if not self.decode_task.done():
            return False
        result = self.decode_task.result()
        return isinstance(result, Stream) or result.ok

    async def outcome(self) -> Answer | Stream:
        """The first non-2xx of either role, else decode's answer.

        Cancelling this leaves both calls running; follow with ``cancel_safely``.
        """
        pending: set[asyncio.Task] = {self.prefill_task, self.decode_task}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if self.prefill_task in done and not self.prefill_task.result().ok:
                self._track(self.abort(self.decode))
                return self.prefill_task.result()
            if self.decode_task in done:
                result = self.decode_task.result()
                if isinstance(result, Stream) or not result.ok or not self.fwd.merge:
                    return result
        return await self._merged(self.prefill_task.result(), self.decode_task.result())

    async def _merged(self, prefill: Answer, decode: Answer) -> Answer:
        """Prefill holds the prompt's logprobs, decode the output's: the client gets both (as mini-lb)."""
        body = await self.offload.run(len(prefill.body) + len(decode.body), merge_logprobs, prefill.body, decode.body)
        return decode if body is None else Answer(decode.status, body, decode.content_type)

    async def abort(self, worker: Worker) -> None:
        for rid in self.fwd.rids:
            try:
                async with self.session.post(f"{worker.url}/abort_request", json={"rid": rid},
                                             timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)) as r:
                    if r.status >= 300:
                        log.warning("abort of %s on %s %s: HTTP %d", rid, worker.role, worker.url, r.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                log.warning("abort of %s on %s %s failed: %s", rid, worker.role, worker.url, exc)

    async def cancel_safely(self, grace_s: float) -> None:
        """Cancel a request the client no longer waits for, never mid-transfer (module doc)."""
        log.info("request %s: client gone or timed out; %s", self.fwd.rids[0],
                 "aborting decode" if self.send_over() else f"waiting up to {grace_s:g} s for the KV send to end")
        if not self.send_over():
            await asyncio.wait({self.prefill_task, self.decode_task}, timeout=grace_s,
                               return_when=asyncio.FIRST_COMPLETED)
        if not self.send_over() and not self.decode_task.done():
            log.warning("request %s: transfer still running after %.0f s; cancelling both roles",
                        self.fwd.rids[0], grace_s)
            await self.abort(self.prefill)
        await self.abort(self.decode)
        await asyncio.wait({self.prefill_task, self.decode_task}, timeout=ABORT_TIMEOUT_S)
        if self.stream_response is not None:
            self.stream_response.close()

