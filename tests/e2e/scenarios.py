"""The incident, as scenarios run against upstream (vulnerable) and hardened builds.

Tenant B sends a prompt longer than the prefill KV pool but within the context
length: upstream treats it as an input-length abort, sends one page of KV and,
before 0.5.21, lets decode run over pages the transfer never wrote.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sglang_hardened.sandbox.cluster import Cluster
from sglang_hardened.sandbox.oracle import Reply, Verdict, differential_check, generate

# Token counts are those of the sandbox tokenizer.
TENANT_A = {"A1": "alpha tenant secret " * 60, "A2": "bravo decode value " * 60}  # 180 tokens: fits
A_TOKENS = 180
OVERSIZED_B = "page cache token key of the " * 100  # 600 tokens: > prefill pool, < context
FITTING_C = "the key " * 40  # 80 tokens: control probe

# Decode's pool must hold B + its 512-token reserve, and be small enough that
# tenant A's requests cycle its whole free list (taken from the front, freed to
# the back), so that B's unwritten pages hold A's KV rather than never-used zeros.
LEAK_PARAMS = dict(prefill_pool_tokens=256, decode_pool_tokens=1200, context_length=1024)
TIMEOUT_PARAMS = dict(prefill_pool_tokens=256, decode_pool_tokens=4096, context_length=1024,
                      waiting_timeout_s=15)


@dataclass
class LeakObservation:
    oversized: Verdict  # probe B after tenant A1 / A2, two rounds
    control: Verdict  # probe C (fits) after the same histories


def observe_leak(cluster: Cluster) -> LeakObservation:
    repeats = math.ceil(cluster.params.decode_pool_tokens / A_TOKENS) + 1
    histories = {label: [prompt] * repeats for label, prompt in TENANT_A.items()}
    return LeakObservation(
        oversized=differential_check(cluster.generate, OVERSIZED_B, histories, rounds=2),
        control=differential_check(cluster.generate, FITTING_C, histories, rounds=2),
    )


@dataclass
class TimeoutObservation:
    at_prefill: Reply  # B sent to prefill alone, as the lb would
    via_lb: Reply  # B through mini-lb (prefill and decode)


def observe_oversized_via_lb(cluster: Cluster) -> TimeoutObservation:
    bootstrap = {"bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.bootstrap_port,
                 "bootstrap_room": random.getrandbits(62)}
    at_prefill = generate(cluster.prefill_url, OVERSIZED_B, extra=bootstrap, timeout=60)
    via_lb = cluster.generate(OVERSIZED_B, timeout=cluster.params.waiting_timeout_s * 4 + 60)
    return TimeoutObservation(at_prefill, via_lb)
