"""Switches, named configurations and the bounds the model is checked in.

A configuration is the set of hardening items that are on. The named ones
say what each upstream release already does (read off its wheel's code)
and what the hardened series for that base adds, so a change
to either is a change to data here, not to the machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from .state import Kind, RequestSpec, Scenario


class Switch(StrEnum):
    """A hardening item of the catalogue (docs/hardening.md) that the model mirrors."""

    H1 = "H1"  # admission-time rejection of a request whose intake failed
    H2 = "H2"  # prefill never reports success over a pending abort
    H3 = (
        "H3"  # page coverage: transfer fails unless every page decode reads was written
    )
    H4 = "H4"  # prefill-side reject/failure pushed to decode at once
    H5 = "H5"  # deferred decode KV release on every failure path
    H6 = "H6"  # bounded batches: a batch cannot outlive the release timeout
    H8 = "H8"  # page ownership tags checked before decode reads
    H13 = "H13"  # the metadata gate's hold on a Success ends at the release timeout

    # catalogue order (H8 before H13) for sorted(), max() and every listing, not the strings'
    def __lt__(self, other: str) -> bool:
        return int(self[1:]) < int(other[1:])

    def __gt__(self, other: str) -> bool:
        return int(self[1:]) > int(other[1:])

    def __le__(self, other: str) -> bool:
        return int(self[1:]) <= int(other[1:])

    def __ge__(self, other: str) -> bool:
        return int(self[1:]) >= int(other[1:])


ALL = frozenset(Switch)


class Agreement(StrEnum):
    """A decision decode's ranks take from their own state and must share before acting,
    once a role runs more than one rank (no effect with one)."""

    RELEASE = "release"  # a deferred release frees on every rank or none: upstream 0.5.23's all-reduce, H5's backport before it
    VERDICT = "verdict"  # H8's tag verdict OR-ed over the ranks (runtime/rank_agreement.py)


AGREED = frozenset(Agreement)

#: What upstream itself does, per release, in the model's terms.
#: 0.5.20 retires an aborted prefill after its forward (H2 for intake
#: errors) but decode is not told; 0.5.21 adds admission rejection and
#: turns deferred release on by default. No release bounds batches by
#: default, checks coverage or tags, pushes prefill failures to decode, or
#: ends the metadata gate's hold on a Success whose row never lands (H13).
UPSTREAM: dict[str, frozenset[Switch]] = {
    "0.5.19": frozenset(),
    "0.5.20": frozenset({Switch.H2}),
    "0.5.21": frozenset({Switch.H1, Switch.H2, Switch.H5}),
    "0.5.22": frozenset({Switch.H1, Switch.H2, Switch.H5}),
    "0.5.23": frozenset({Switch.H1, Switch.H2, Switch.H5}),
}

#: What each release's decode ranks already agree on. Only 0.5.23 all-reduces its deferred
#: releases ("releasing only on some ranks would diverge admission"); before it, each rank
#: frees on its own ack or deadline. Upstream has no tag verdict to share.
UPSTREAM_AGREED: dict[str, frozenset[Agreement]] = {
    base: frozenset({Agreement.RELEASE}) if base == "0.5.23" else frozenset()
    for base in UPSTREAM
}


@dataclass(frozen=True)
class Config:
    """A named or ad-hoc set of switches and the outcome CI expects of it."""

    name: str
    switches: frozenset[Switch]
    summary: str
    expect_clean: bool
    agreed: frozenset[Agreement] = AGREED

    @property
    def machine(self) -> tuple[frozenset[Switch], frozenset[Agreement]]:
        """What the explored machine depends on: configurations equal here (every hardened
        base) explore the same state graph, whatever their names."""
        return self.switches, self.agreed


def _named() -> dict[str, Config]:
    configs: dict[str, Config] = {}
    for base, upstream in UPSTREAM.items():
        on = ", ".join(sorted(upstream)) or "none"
        configs[f"upstream-{base}"] = Config(
            f"upstream-{base}",
            upstream,
            f"upstream {base} as released (items: {on})",
            False,
            UPSTREAM_AGREED[base],
        )
    for base, upstream in UPSTREAM.items():
        added = ", ".join(sorted(ALL - upstream))
        configs[f"hardened-{base}"] = Config(
            f"hardened-{base}",
            ALL,
            f"{base} with its series (series adds {added})",
            True,
        )
    return configs


NAMED: dict[str, Config] = _named()


def parse_config(name: str) -> Config:
    """A named configuration, or a comma-separated switch list ("none" for none).

    An explicit list is expected clean only when it holds every switch.
    """
    if name in NAMED:
        return NAMED[name]
    words = [w.strip().upper() for w in name.split(",") if w.strip()]
    if words == ["NONE"]:
        words = []
    try:
        switches = frozenset(Switch(w) for w in words)
    except ValueError:
        known = ", ".join(NAMED)
        raise ValueError(
            f"unknown configuration {name!r}: use one of {known}, "
            f"or switches like 'H1,H3,H5' ('none' for none)"
        ) from None
    label = ",".join(sorted(switches)) or "none"
    return Config(label, switches, f"switches {label}", switches == ALL)


#: Items whose job another item does within this model: turning one off
#: alone leaves the model clean, turning it off together with its cover
#: breaks a property. Tests check both halves of every entry.
COVERED_BY: dict[Switch, tuple[frozenset[Switch], str]] = {
    Switch.H1: (
        frozenset({Switch.H2}),
        "H2 retires the request after its one-token forward, before any "
        "transfer; H1 still saves the bootstrap, allocation and forward",
    ),
    Switch.H2: (
        frozenset({Switch.H1}),
        "with H1 an over-pool request never reaches the transfer whose "
        "success H2 would suppress",
    ),
    Switch.H3: (
        frozenset({Switch.H8}),
        "a page the transfer did not write keeps a foreign tag, so the tag "
        "check fails the request before its first decode step",
    ),
}

#: The bounds. Pool of 4 pages, FIFO free list, every page warm with an
#: earlier tenant's KV; 2 requests per scenario, each its own tenant; one
#: page per chunk; one transfer lane per rank; at most 2 faults (client
#: disconnect, transport failure, a metadata row lost after Success, crash of
#: either node, and in the over-pool workloads a write reported done that
#: never landed) per run, 1 with two ranks per role. Timeouts fire whenever
#: their guard allows.
OVER_POOL = Scenario(
    "over-pool",
    (RequestSpec(Kind.FITS, 2, 2), RequestSpec(Kind.OVER, 3, 1)),
    pool_pages=4,
    faults=2,
    skips=True,
)
TRUNCATION = Scenario(
    "truncation",
    (RequestSpec(Kind.FITS, 2, 2), RequestSpec(Kind.TRUNC, 3, 2)),
    pool_pages=4,
    faults=2,
)


def two_ranks(scenario: Scenario) -> Scenario:
    """The same workload with two ranks per role and 1 fault (two lanes interleave: with 2
    faults the over-pool scenario alone has four times the states)."""
    return replace(scenario, name=f"{scenario.name}-tp2", faults=1, ranks=2)


SCENARIOS: tuple[Scenario, ...] = (
    OVER_POOL,
    TRUNCATION,
    Scenario(
        "abort-reuse",
        (RequestSpec(Kind.FITS, 2, 2), RequestSpec(Kind.FITS, 3, 3)),
        pool_pages=4,
        faults=2,
    ),
    two_ranks(OVER_POOL),
)

#: Wider bounds, about ten times the work: three tenants contend for the
#: same 4 pages, with at most 1 fault per run; truncation with two ranks.
WIDE_SCENARIOS: tuple[Scenario, ...] = SCENARIOS + (
    two_ranks(TRUNCATION),
    Scenario(
        "three-tenants",
        (
            RequestSpec(Kind.FITS, 2, 2),
            RequestSpec(Kind.OVER, 3, 1),
            RequestSpec(Kind.FITS, 2, 2),
        ),
        pool_pages=4,
        faults=1,
    ),
)
