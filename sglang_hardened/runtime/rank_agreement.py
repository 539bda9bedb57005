"""One verdict for every tensor-parallel rank of a server.

Each decode rank runs the same scheduler loop over its own shard of the KV pool, and the
ranks stay in step only while they admit, abort and batch the same requests: upstream
all-reduces its transfer polls for that reason. A hardened check that reads a rank's own
pages (H8's tags) can fail on one rank only, when one rank's transfer went wrong; if that
rank aborts the request while the others decode it, their next collective never matches
and decode hangs for every tenant. So a rank's refusal is shared before anyone acts on it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def refused_on_any_rank(group: dist.ProcessGroup | None, refused: bool) -> bool:
    """Whether any rank of ``group`` (the scheduler's CPU group) refuses: one MAX all-reduce of
    one int, which every rank must call for the same request in the same order. A group of one
    rank, or none, is this rank's own verdict, with no collective."""
    if group is None or dist.get_world_size(group) == 1:
        return refused
    flag = torch.tensor([int(refused)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
