"""One soak request of a kind, sent through the load balancer over plain HTTP; the client
may hang up on it at a chosen moment. Never raises on what the server does."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from .catalogue import Catalogue, Prompt
from .plan import Step

GIVE_UP_POLL_S = 0.25  # how often a waiting client asks whether to give up

# Bodies the servers must refuse with a 4xx (each reaches a different check).
MALFORMED = (
    b'{"text": "the key", "sampling_params": {"max_new_tokens": -1}}',
    b'{"text": "the key", "sampling_params": {"temperature": "hot"}}',
    b'{"text": "the key", "sampling_params": ',
    b'{"sampling_params": {"max_new_tokens": 4}}',
    b'{"text": "the key", "sampling_params": {"n": null}}',
)


@dataclass(frozen=True)
class Sent:
    """What came back: the status (None: no HTTP answer, or the client hung up), each
    sequence's output ids on a 200, the body (a stream's last event), and the wait."""

    status: int | None
    outputs: tuple[tuple[int, ...], ...] | None
    body: str
    sent_at: float
    seconds: float
    hung_up: bool = False


def prompts_of(step: Step, cat: Catalogue) -> list[Prompt]:
    """The prompts a step sends (two for a batch)."""
    pool = cat.prompts(step.kind)
    first = pool[step.prompt % len(pool)]
    return [first, pool[step.variant % len(pool)]] if step.kind == "batch" else [first]


def body_of(step: Step, cat: Catalogue, rid: str) -> bytes:
    if step.kind == "malformed":
        return MALFORMED[step.variant % len(MALFORMED)]
    prompts = prompts_of(step, cat)
    params = [{"temperature": 0.0, "max_new_tokens": p.max_new_tokens, **({"n": 2} if step.kind == "n2" else {})}
              for p in prompts]
    if step.kind == "batch":
        return json.dumps({"text": [p.text for p in prompts], "sampling_params": params}).encode()
    body = {"text": prompts[0].text, "sampling_params": params[0], "stream": step.kind == "stream"}
    return json.dumps(body | ({} if step.kind == "n2" else {"rid": rid})).encode()  # n=2 expands one rid into several


def send(lb_url: str, step: Step, cat: Catalogue, rid: str, timeout_s: float, hang_up_after_s: float | None,
         give_up: Callable[[float], bool] = lambda sent_at: False) -> Sent:
    """POST the step's request; hang up ``hang_up_after_s`` after sending if no answer has ended by
    then; stop waiting once ``give_up(sent_at)`` says so (polled), or after ``timeout_s`` at most."""
    url = urlsplit(lb_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    sent_at = time.monotonic()
    done = threading.Event()
    gave_up = threading.Event()

    def watch() -> None:
        while not done.wait(GIVE_UP_POLL_S):
            if give_up(sent_at):
                gave_up.set()
                with contextlib.suppress(OSError, AttributeError):
                    conn.sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns at once
                return

    threading.Thread(target=watch, daemon=True).start()
    hang_up_at = sent_at + hang_up_after_s if hang_up_after_s is not None else None
    give_up_at = sent_at + timeout_s

    def wait_budget() -> float:
        return max(0.01, min(hang_up_at or give_up_at, give_up_at) - time.monotonic())

    def ended(status: int | None, outputs=None, body: str = "") -> Sent:
        done.set()
        conn.close()
        if gave_up.is_set() and status is None:
            body = "no answer: the client gave up waiting"
        return Sent(status, outputs, body, sent_at, time.monotonic() - sent_at)

    try:
        conn.request("POST", "/generate", body=body_of(step, cat, rid), headers={"content-type": "application/json"})
        conn.sock.settimeout(wait_budget())
        reply = conn.getresponse()
        if step.kind == "stream" and reply.status == 200:
            return _read_stream(reply, conn, wait_budget, ended)
        conn.sock.settimeout(wait_budget())
        text = reply.read().decode(errors="replace")
    except (socket.timeout, TimeoutError):
        if hang_up_at and time.monotonic() >= hang_up_at - 0.01:
            done.set()
            conn.close()
            return Sent(None, None, "the client hung up", sent_at, time.monotonic() - sent_at, hung_up=True)
        return ended(None, body=f"no answer within {timeout_s:.0f} s")
    except (OSError, http.client.HTTPException) as e:
        return ended(None, body=f"connection failed: {e!r}")
    if reply.status != 200:
        return ended(reply.status, body=text)
    try:
        answer = json.loads(text)
        items = answer if isinstance(answer, list) else [answer]
        return ended(200, tuple(tuple(item["output_ids"]) for item in items), text[:500])
    except (ValueError, KeyError, TypeError):
        return ended(200, None, text[:500])  # a 200 without outputs: the judge calls it wrong


def _read_stream(reply, conn, wait_budget, ended) -> Sent:
    """Server-sent events: each carries the output so far; an ``error`` event ends it with its code."""
    last = None
    while True:
        conn.sock.settimeout(wait_budget())
        line = reply.readline()
        if not line:
            return ended(None, body="the stream ended before [DONE]")
        line = line.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return ended(200, (tuple(last["output_ids"]),) if last else None, json.dumps(last)[:500])
        try:
            event = json.loads(data)
        except ValueError:
            return ended(200, None, data[:500])
        if "error" in event:
            error = event["error"]
            code = error.get("code") if isinstance(error, dict) else None
            return ended(code if isinstance(code, int) else 500, body=data[:500])
        finish = (event.get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":  # an abort ends a stream with an event, not a status
            code = finish.get("status_code")
            return ended(code if isinstance(code, int) else 500, body=json.dumps(finish)[:500])
        last = event
