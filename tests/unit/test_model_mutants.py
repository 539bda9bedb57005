"""Break one mechanism of the hardened protocol at a time: the checker
must notice. This shows the clean results come from the mechanisms, not
from a model too coarse to see them fail."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sglang_hardened.model.checker import explore
from sglang_hardened.model.configs import ALL, SCENARIOS, Switch
from sglang_hardened.model.machine import NORMAL, Event, Machine, Step
from sglang_hardened.model.state import D_HELD, State


class _AckBeforeDrain(Machine):
    """Prefill acks an abort while the room's batch is still writing."""

    def successors(self, s: State) -> Iterator[Step]:
        yield from super().successors(s)
        for r, q in enumerate(s.reqs):
            if q.d == D_HELD and s.busy(r):
                yield Step(Event("abort_ack", r), self._release(s, r), NORMAL)


class _NoAbortFrame(Machine):
    """Decode holds the pages but never tells prefill to stop sending."""

    def _decode_fails(self, s: State, r: int) -> State:
        held = super()._decode_fails(s, r)
        q = held.reqs[r]
        if q.d != D_HELD:
            return held
        q = q._replace(p_abort=s.reqs[r].p_abort)
        return held._replace(reqs=held.reqs[:r] + (q,) + held.reqs[r + 1 :])


class _CrashKeepsWriting(Machine):
    """The batch into a crashed decode keeps going into the new process."""

    def _decode_crash(self, s: State) -> State:
        return super()._decode_crash(s)._replace(lanes=s.lanes)


class _TagsStampedByDecode(Machine):
    """Decode stamps the tags itself when the room reports success, so they
    vouch for pages nobody wrote (H8's rule: the tag must travel with the
    data it vouches for)."""

    def _commit(self, s: State, r: int) -> State:
        mine = set(s.reqs[r].alloc)
        stamped = tuple(
            tuple(r if p in mine else w for p, w in enumerate(pages)) for pages in s.pages
        )
        return super()._commit(s._replace(pages=stamped), r)._replace(pages=s.pages)


MUTANTS = [
    (_AckBeforeDrain, ALL, "reuse-under-write"),
    (_NoAbortFrame, ALL, "reuse-under-write"),
    (_CrashKeepsWriting, ALL, "reuse-under-write"),
    # with coverage (H3) off, only the tags stand between decode and the leak
    (_TagsStampedByDecode, ALL - {Switch.H3}, "foreign-read"),
]


@pytest.mark.parametrize(
    ("mutant", "switches", "kind"), MUTANTS, ids=lambda m: getattr(m, "__name__", "")
)
def test_mutant_is_caught(
    mutant: type[Machine], switches: frozenset[Switch], kind: str
) -> None:
    found = {f.kind for sc in SCENARIOS for f in explore(mutant(sc, switches)).findings}
    assert kind in found
