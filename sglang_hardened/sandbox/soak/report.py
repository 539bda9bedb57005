"""What a soak found: requests by outcome, faults by type, violations by kind, the worst
wait and each server's memory growth, as a short table and as JSON."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ...common.table import format_table
from .faults import FaultEvent
from .judge import OUTCOMES, Outcome

EXAMPLES = 3  # details kept per violation kind
FAILURE_CHARS = 120  # failed requests are counted by the start of their error


@dataclass(frozen=True)
class Rss:
    """A server's resident memory (its whole process group) at the soak's start and end."""

    start_mib: float
    end_mib: float
    restarted: bool  # killed during the soak: the end figure is a new process's

    @property
    def growth_mib(self) -> float:
        return self.end_mib - self.start_mib


@dataclass
class SoakReport:
    cluster: dict  # base, backend, lb, servers ("2x2": prefills x decodes)
    seed: int
    seconds: float = 0.0
    bound_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[FaultEvent] = field(default_factory=list)
    end_violations: list[tuple[str, str]] = field(default_factory=list)  # (kind, detail): ledger, pages, processes
    rss: dict[str, Rss] = field(default_factory=dict)

    def violations(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for o in self.outcomes:
            if o.violation:
                found.setdefault(o.verdict, []).append(f"client {o.step.client} #{o.step.index} {o.step.kind}"
                                                       f"{f' ({o.step.fault})' if o.step.fault else ''}: {o.detail}")
        for kind, detail in self.end_violations:
            found.setdefault(kind, []).append(detail)
        return found

    @property
    def ok(self) -> bool:
        return not self.violations()

    @property
    def worst_wait_s(self) -> float:
        return max((o.seconds for o in self.outcomes if o.verdict != "hung-up"), default=0.0)

    def to_json(self) -> dict:
        faults = Counter((f.name, f.landed) for f in self.faults)
        return {
            "ok": self.ok, "cluster": self.cluster, "seed": self.seed, "seconds": round(self.seconds, 1),
            "requests": len(self.outcomes), "bound_s": round(self.bound_s, 1),
            "outcomes": dict(Counter(o.verdict for o in self.outcomes if not o.violation)),
            "by_kind": {k: dict(Counter(o.verdict for o in self.outcomes if o.step.kind == k))
                        for k in sorted({o.step.kind for o in self.outcomes})},
            "faults": {name: {"landed": faults[(name, True)], "skipped": faults[(name, False)],
                              "on": dict(sorted(Counter(f.targets[0] for f in self.faults
                                                        if f.name == name and f.landed and len(f.targets) == 1).items()))}
                       for name in sorted({f.name for f in self.faults})},
            "violations": {k: {"count": len(v), "examples": v[:EXAMPLES]} for k, v in self.violations().items()},
            "failures": dict(Counter(o.detail[:FAILURE_CHARS] for o in self.outcomes if o.verdict == "failed")
                             .most_common(EXAMPLES * 2)),
            "worst_wait_s": round(self.worst_wait_s, 1),
            "rss_mib": {name: {"start": round(r.start_mib), "end": round(r.end_mib), "growth": round(r.growth_mib),
                               "restarted": r.restarted} for name, r in self.rss.items()},
        }

    def table(self) -> str:
        data = self.to_json()
        rows = [("requests", verdict, n, OUTCOMES[verdict]) for verdict, n in sorted(data["outcomes"].items())]
        rows += [("fault", name, f"{c['landed']} (+{c['skipped']} skipped)" if c["skipped"] else c["landed"],
                  ", ".join(f"{server} {n}" for server, n in c["on"].items()) if len(c["on"]) > 1 else "")
                 for name, c in data["faults"].items()]
        rows += [("VIOLATION", kind, v["count"], v["examples"][0][:110]) for kind, v in data["violations"].items()]
        rows += [("worst wait", "", f"{data['worst_wait_s']} s", f"bound {data['bound_s']} s")]
        rows += [("rss", name, f"{r['growth']:+d} MiB", f"{r['start']} -> {r['end']} MiB" + " (restarted)" * r["restarted"])
                 for name, r in data["rss_mib"].items()]
        verdict = "no violations" if self.ok else f"{sum(len(v) for v in self.violations().values())} violations"
        head = (f"soak of {self.cluster['base']} {self.cluster['backend']} {self.cluster['servers']} "
                f"behind {self.cluster['lb']}, seed {self.seed}: "
                f"{len(self.outcomes)} requests in {self.seconds:.0f} s, {verdict}")
        return head + "\n" + format_table(("what", "which", "count", "note"), rows)

