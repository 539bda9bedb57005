"""One verdict for every rank of a server that must act as one.

Each rank of a tensor-parallel server runs the same scheduler loop over its own shard of the
KV pool, and the ranks stay in step only while they admit, hold, free and abort the same
requests at the same iteration: upstream all-reduces its transfer polls, and decode's deferred
releases, for that reason. A hardened decision that reads a rank's own state (H8's tags on
decode; on prefill, H5's count of chunks its own transfer worker still sends) can differ
between ranks when one rank's transfer went wrong. If one rank then aborts, holds or frees
what the others do not, their next collective never matches and the server answers no one
again (both found on TP 2/2 clusters, tests/e2e/test_multi_rank.py). So such a decision is
shared before any rank acts on it.
"""

from __future__ import annotations

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


def scheduler_groups(scheduler: object | None) -> Groups:
    """The groups a prefill scheduler all-reduces its transfer polls over (attention CP and TP,
    as upstream's ``poll_and_all_reduce_attn_cp_tp_group``); none without a scheduler."""
    return tuple(getattr(scheduler, name, None) for name in ("attn_cp_cpu_group", "attn_tp_cpu_group"))
