"""One verdict for every rank of a server that must act as one.

Each rank of a tensor-parallel server runs the same scheduler loop over its own shard of the
KV pool, and the ranks stay in step only while they admit, hold, free and abort the same
requests at the same iteration: upstream all-reduces its transfer polls, and decode's deferred
releases, for that reason. A hardened decision that reads a rank's own state (H3's metadata
row and H8's tags on decode; on prefill, H5's count of chunks its own transfer worker still sends) can differ
between ranks when one rank's transfer went wrong. If one rank then aborts, holds or frees
what the others do not, their next collective never matches and the server answers no one
again (both found on TP 2/2 clusters, tests/e2e/test_multi_rank.py). So such a decision is
shared before any rank acts on it. Upstream 0.5.23 does the same for decode's failure holds and
deferred releases (MAX and MIN all-reduces in ``disaggregation/decode.py``); 0.5.19-0.5.22 get
that here (``hold_anywhere``, ``acks_to_await``, ``release_together``), and the protocol
model shows why (``model necessity``: the release agreement, with two ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

Groups = tuple[dist.ProcessGroup | None, ...]


def any_rank(flags: list[bool], groups: Groups) -> list[bool]:
    """Each flag OR-ed over every rank of each group (the scheduler's CPU groups): one MAX
    all-reduce per group of more than one rank, which every rank must call with the same
    number of flags in the same order. No such group: the flags as they are, no collective."""
    wide = [g for g in groups if g is not None and dist.get_world_size(g) > 1]
    if not flags or not wide:
        return list(flags)
    reduced = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    for group in wide:
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in reduced.tolist()]


def every_rank(flags: list[bool], groups: Groups) -> list[bool]:
    """Each flag AND-ed over every rank of each group (a MIN all-reduce; as ``any_rank``)."""
    return [not f for f in any_rank([not f for f in flags], groups)]


def refused_elsewhere(refused_here: bool, transfer_queue: object) -> bool:
    """Whether another rank of this decode refuses a request this rank would admit: one MAX
    all-reduce over the transfer queue's gloo group (attention TP), which every rank reaches for
    the same committed requests in the same order, refusing or not (so never behind a
    short-circuit on ``refused_here``)."""
    return any_rank([refused_here], (getattr(transfer_queue, "gloo_group", None),))[0] and not refused_here


def hold_anywhere(notified: bool, group: dist.ProcessGroup | None) -> bool:
    """Decode's choice, for a transfer that failed, to hold its pages for prefill's drain ack:
    made by every rank if any rank must. Whether the ABORT went out is rank-local (one rank's
    receiver may not have bootstrapped yet); a rank that freed while another held would admit
    into pages the other still counts as taken. Every rank reaches it for the same failed
    requests in the same order (their polls are all-reduced)."""
    return any_rank([notified], (group,))[0]


def acks_to_await(receiver: object) -> int:
    """The drain acks a rank's hold of a failed transfer waits for: one per prefill rank its
    receiver sent the ABORT to, none when it holds only because another rank must (it sent
    none, and may not have bootstrapped at all: then it is ready at once and waits, through
    ``release_together``, for the rank that must). 0.5.23's rule."""
    return len(receiver.bootstrap_infos) if receiver.abort_notified else 0


def release_together(
    held: Sequence[tuple], leaving: Sequence[tuple], group: dist.ProcessGroup | None
) -> tuple[list[tuple], list[tuple]]:
    """One pass of decode's deferred releases, agreed: an entry of ``held`` (upstream's list,
    the same on every rank) leaves only when it leaves on every rank. Acks and deadlines are
    rank-local, so one rank would free pages the others still hold. ``held`` entries and
    ``leaving`` tuples both start with their DecodeRequest; returns (leaving, still held), the
    latter in ``held``'s order."""
    going = {id(entry[0]) for entry in leaving}
    agreed = every_rank([id(entry[0]) in going for entry in held], (group,))
    stay = {id(entry[0]) for entry, ok in zip(held, agreed) if not ok}
    return [t for t in leaving if id(t[0]) not in stay], [e for e in held if id(e[0]) in stay]


def scheduler_groups(scheduler: object | None) -> Groups:
    """The groups a prefill scheduler all-reduces its transfer polls over (attention CP and TP,
    as upstream's ``poll_and_all_reduce_attn_cp_tp_group``); none without a scheduler."""
    return tuple(getattr(scheduler, name, None) for name in ("attn_cp_cpu_group", "attn_tp_cpu_group"))
