"""Which servers a sandbox cluster runs, and how a load balancer is told of them.

A cluster runs N prefills and M decodes, each its own process, port and transfer engine (a
prefill also its bootstrap port). The first of each role keeps the role's bare name ("prefill",
"decode"), so a one-pair cluster is named as it always was; the others are "prefill-1",
"decode-1", ... Pure: the cluster starts what these say, and unit tests read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parameters name the servers; the cluster starts what this module says
    from .cluster import ClusterParams

ROLES = ("prefill", "decode")


def server_names(role: str, count: int) -> list[str]:
    """The names of a role's ``count`` servers, in order."""
    return [role if i == 0 else f"{role}-{i}" for i in range(count)]


def role_of(name: str) -> str:
    """The role of server ``name`` ("prefill-2" is a prefill)."""
    role = name.split("-", 1)[0]
    if role not in ROLES:
        raise ValueError(f"{name!r} names no server: servers are prefill[-N] and decode[-N]")
    return role


@dataclass(frozen=True)
class ServerSpec:
    """One server to start: its name, role, KV pool and context length, and the port asked for
    (0: a free one)."""

    name: str
    role: str
    pool_tokens: int
    context_length: int
    port: int = 0


def server_specs(p: ClusterParams) -> list[ServerSpec]:
    """Every server of the cluster ``p`` describes, prefills first. A port asked for is the first
    server's of its role (the others' are picked free: one port cannot serve two). A prefill given
    a limit of its own runs a pool of that size and a context length no longer than it, as an
    operator sizes a smaller prefill: its input limit is lower, and a hardened prefill starts (H7's
    start-up check) so that decode's check across roles is what meets it. A prefill given a context
    length of its own runs that, whatever its pool."""
    pools = p.prefill_limits or (p.prefill_pool_tokens,) * p.prefills
    contexts = (list(p.prefill_contexts) or [min(p.context_length, pool) for pool in p.prefill_limits]
                or [p.context_length] * p.prefills)
    prefills = [ServerSpec(name, "prefill", pool, context, p.prefill_port if i == 0 else 0)
                for i, (name, pool, context) in enumerate(zip(server_names("prefill", p.prefills), pools, contexts))]
    return prefills + [ServerSpec(name, "decode", p.decode_pool_tokens, p.decode_context_length or p.context_length,
                                  p.decode_port if i == 0 else 0)
                       for i, name in enumerate(server_names("decode", p.decodes))]


def lb_server_args(kind: str, prefills: list[tuple[str, int]], decodes: list[str]) -> list[str]:
    """The servers' part of load balancer ``kind``'s command line: every prefill (URL and bootstrap
    port) and every decode. The upstream routers (mini-lb, smg) take ``--prefill URL PORT``,
    ``sglang-hardened lb`` ``--prefill URL,PORT``."""
    args: list[str] = []
    for url, bootstrap in prefills:
        args += ["--prefill", f"{url},{bootstrap}"] if kind == "hardened" else ["--prefill", url, str(bootstrap)]
    for url in decodes:
        args += ["--decode", url]
    return args
