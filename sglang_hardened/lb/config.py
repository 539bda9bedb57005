"""What an operator sets for the load balancer."""

from __future__ import annotations

from dataclasses import dataclass

from ..common.errors import HardenedError

# JSON of up to this many bytes (a client's body; a logprob merge's two answers) is parsed and
# written on the event loop, which waits under a millisecond for it; a hop to a worker process
# adds about half of one to the request (docs/operating.md). Larger work goes to the processes:
# json holds the GIL, so in a thread it would stall the loop every tenant's stream shares as long.
INLINE_JSON_BYTES = 64 * 1024
# Worker processes for that larger work: two, so one large body does not queue behind another.
JSON_PROCESSES = 2
# Connections one request holds to the workers at once: its prefill and decode calls, and an
# abort while both are open (its slot under --max-requests is held until all of them end).
CONNECTIONS_PER_REQUEST = 3


@dataclass(frozen=True)
class PrefillAddr:
    """A prefill worker's HTTP URL and its KV bootstrap port (None: SGLang's default)."""

    url: str
    bootstrap_port: int | None = None


@dataclass(frozen=True)
class LbConfig:
    prefill: tuple[PrefillAddr, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "random"
    request_timeout_s: float = 600.0  # the client gets 504 after this
    # After a disconnect or timeout: how long a transfer that may be running is
    # given to end (prefill answers) before decode is cancelled anyway.
    transfer_grace_s: float = 60.0
    max_body_bytes: int = 32 * 1024 * 1024
    health_interval_s: float = 5.0
    drain_timeout_s: float = 60.0
    body_timeout_s: float = 30.0  # a client's body must arrive within this; then 408
    max_requests: int = 1024  # requests open at once, each until its worker calls and aborts end; more get 503
    max_answer_bytes: int = 256 * 1024 * 1024  # a worker's answer (non-streaming) over this is a 502

    @property
    def max_connections(self) -> int:
        """The connector's limit: what ``max_requests`` requests and one health check per worker
        hold at most, so no call of the lb's waits behind its own, and no leak goes unbounded."""
        return self.max_requests * CONNECTIONS_PER_REQUEST + len(self.prefill) + len(self.decode)

    def validate(self) -> None:
        if not self.prefill or not self.decode:
            raise HardenedError("the load balancer needs at least one --prefill and one --decode worker")
        for url in [p.url for p in self.prefill] + list(self.decode):
            if not url.startswith(("http://", "https://")):
                raise HardenedError(f"worker URL {url!r} must start with http:// or https://")
        if min(self.request_timeout_s, self.transfer_grace_s, self.health_interval_s, self.max_body_bytes,
               self.body_timeout_s, self.max_requests, self.max_answer_bytes) <= 0:
            raise HardenedError("timeouts, the health interval and the limits must be positive")
