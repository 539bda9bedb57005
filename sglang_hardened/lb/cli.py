"""``sglang-hardened lb``: parse options, run the server."""

from __future__ import annotations

import asyncio
import logging

import click

from .config import LbConfig, PrefillAddr


def _prefill(value: str) -> PrefillAddr:
    url, _, port = value.partition(",")
    if port and not port.isdigit():
        raise click.BadParameter(f"{value!r}: expected URL or URL,BOOTSTRAP_PORT")
    return PrefillAddr(url, int(port) if port else None)


@click.command("lb")
@click.option("--prefill", "prefill", multiple=True, required=True, metavar="URL[,BOOTSTRAP_PORT]",
              help="A prefill worker and its KV bootstrap port (repeatable).")
@click.option("--decode", multiple=True, required=True, metavar="URL", help="A decode worker (repeatable).")
@click.option("--host", default=LbConfig.host, show_default=True)
@click.option("--port", type=int, default=LbConfig.port, show_default=True)
@click.option("--policy", default=LbConfig.policy, show_default=True,
              help="random, round-robin, or a name registered under the entry-point group "
                   "sglang_hardened.lb.routing.")
@click.option("--request-timeout", type=float, default=LbConfig.request_timeout_s, show_default=True,
              help="Seconds until the answer (streaming: its first output); then 504.")
@click.option("--transfer-grace", type=float, default=LbConfig.transfer_grace_s, show_default=True,
              help="After a disconnect or timeout, seconds a KV transfer may still run before decode is cancelled.")
@click.option("--max-body-bytes", type=int, default=LbConfig.max_body_bytes, show_default=True)
@click.option("--health-interval", type=float, default=LbConfig.health_interval_s, show_default=True, help="Seconds between health checks.")
@click.option("--drain-timeout", type=float, default=LbConfig.drain_timeout_s, show_default=True,
              help="On SIGTERM, seconds open requests get to finish.")
@click.option("--body-timeout", type=float, default=LbConfig.body_timeout_s, show_default=True,
              help="Seconds a client has to send its request body; then 408.")
@click.option("--max-requests", type=int, default=LbConfig.max_requests, show_default=True,
              help="Requests handled at once; more get 503.")
@click.option("--max-answer-bytes", type=int, default=LbConfig.max_answer_bytes, show_default=True,
              help="A worker's whole answer over this is a 502 (as is a first stream event over 2 MiB).")
def lb(prefill: tuple[str, ...], decode: tuple[str, ...], host: str, port: int, policy: str,
       request_timeout: float, transfer_grace: float, max_body_bytes: int, health_interval: float,
       drain_timeout: float, body_timeout: float, max_requests: int, max_answer_bytes: int) -> None:
    """Prefill/decode load balancer: first error wins, never aborts mid-transfer (H9).

    Same request protocol as sglang-router's mini-lb. The client gets the
    first non-2xx answer of prefill or decode, with its body; a client that
    disconnects has its request cancelled on the workers only once no KV
    write into decode's pages can still land.

    \b
    Example:
      sglang-hardened lb --prefill http://10.0.0.1:30000,8998 --decode http://10.0.0.2:30000 --port 8000
    """
    from .server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = LbConfig(tuple(map(_prefill, prefill)), decode, host, port, policy, request_timeout,
                      transfer_grace, max_body_bytes, health_interval, drain_timeout, body_timeout,
                      max_requests, max_answer_bytes)
    asyncio.run(serve(config))
