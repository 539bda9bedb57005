"""Routing policies and the hook for your own.

A policy chooses one prefill and one decode worker for a request, from the
healthy ones. Register your own under the entry-point group
``sglang_hardened.lb.routing`` in your package's metadata, e.g. in
pyproject.toml::

    [project.entry-points."sglang_hardened.lb.routing"]
    by-tenant = "mypkg.routing:ByTenant"

then run ``sglang-hardened lb --policy by-tenant …``. The object the entry
point names is called with no arguments and must return something with
``choose(prefill, decode, payload) -> (prefill_worker, decode_worker)``;
``payload`` is the client's parsed JSON body (read it, do not change it). A
policy that never reads it says so with ``reads_payload = False``: the lb
then never builds a large body's objects in its own process, where they
would stall every other request (``offload``); it gets an empty mapping.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Protocol

from ..common.errors import HardenedError
from .workers import Worker

ENTRY_POINT_GROUP = "sglang_hardened.lb.routing"


class RoutingPolicy(Protocol):
    def choose(self, prefill: Sequence[Worker], decode: Sequence[Worker],
               payload: Mapping[str, object]) -> tuple[Worker, Worker]: ...


class RandomPolicy:
    """mini-lb's policy: a random healthy worker of each role."""

    reads_payload = False

    def choose(self, prefill, decode, payload):
        return random.choice(prefill), random.choice(decode)


class RoundRobinPolicy:
    """Each role's healthy workers in turn."""

    reads_payload = False

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, prefill, decode, payload):
        n = next(self._turn)
        return prefill[n % len(prefill)], decode[n % len(decode)]


def reads_payload(policy: RoutingPolicy) -> bool:
    return getattr(policy, "reads_payload", True)


BUILTIN = {"random": RandomPolicy, "round-robin": RoundRobinPolicy}


def load_policy(name: str) -> RoutingPolicy:
    """A built-in policy, or the one an installed package registers under ``name``."""
    if name in BUILTIN:
        return BUILTIN[name]()
    found = entry_points(group=ENTRY_POINT_GROUP, name=name)
    if not found:
        known = sorted(BUILTIN) + sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
        raise HardenedError(f"no routing policy {name!r}: known are {', '.join(known)} "
                            f"(register yours under the entry-point group {ENTRY_POINT_GROUP})")
    policy = next(iter(found)).load()()
    if not callable(getattr(policy, "choose", None)):
        raise HardenedError(f"routing policy {name!r} has no choose(prefill, decode, payload) method")
    return policy
