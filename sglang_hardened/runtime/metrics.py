"""Hardening events as Prometheus metrics on SGLang's own ``/metrics`` (``--enable-metrics``).

SGLang serves ``/metrics`` in prometheus_client's multiprocess mode: it sets
``PROMETHEUS_MULTIPROC_DIR`` before it starts its processes, every process (the HTTP server,
each scheduler, the bootstrap server) writes its samples to files there, and the route sums
them. The runtime layer writes its own there, named ``sglang_hardened_*`` and labelled by
hardening id, role and a reason or outcome from the fixed lists below: never a room, a request
id or anything a tenant sent, so a scrape reveals counts and nothing else.

Without ``--enable-metrics`` (no ``PROMETHEUS_MULTIPROC_DIR``) nothing is imported or written.
prometheus_client picks its multiprocess storage when first imported, so it is imported here
only at the first write, in a process SGLang has already set up. A write that fails is
counted in ``metric_errors_total`` by the metric it was for and logged once per metric, and
every other metric goes on counting: counting never fails a request, and a scrape says which
series are missing events.

At start-up (``at_start``, from H0's seam) every label set the lists allow is written at 0 for
each counter and gauge, and ``build_info`` at 1: Prometheus' ``increase`` needs a sample before
the first event to see that event, and ``build_info`` tells a hardened server from an upstream one.
``metrics_healthy`` is 1 from then until a write fails in any process; /server_info says the
same (``health``), with what failed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("sglang_hardened")

PREFIX = "sglang_hardened"
ROLES = ("prefill", "decode", "api")  # api: where any server first reads a request, role unknown
# What each id refuses or ends a request for, by the role that counts it: the only (role,
# reason) pairs its labels take, each exported at 0 from start-up (docs/metrics.md's table).
REFUSALS: dict[str, dict[str, tuple[str, ...]]] = {
    # the scheduler's admission refusal on prefill (upstream's own check from 0.5.21) or a server outside
    # PD (api); the tokenizer manager's, any role, of a prompt past the context (runtime/input_limits.py,
    # H1's patch 0042): upstream's refusals of H1's kind, counted on every base
    "H1": {"prefill": ("input_too_long", "over_context", "over_context_with_output"),
           "decode": ("over_context", "over_context_with_output"),
           "api": ("input_too_long", "over_context", "over_context_with_output")},
    "H3": {"decode": ("unstated_coverage", "prompt_length_differs", "another_rank"), "prefill": ("sender_shortfall",)},
    "H4": {"decode": ("prefill_ended",)},
    "H7": {"decode": ("limit_below_decode", "limit_unreadable")},  # per refused readiness check, not per request
    "H8": {"decode": ("tag_mismatch", "fail_closed", "another_rank")},
    "H11": {"prefill": ("parallel_sampling",), "decode": ("parallel_sampling",)},
    "H12": {"api": ("sampling_params",)},
    "H13": {"decode": ("metadata_lost",)},
}
# How a hold of KV pages (H5) ends: decode's past its release timeout, prefill's source pages.
HOLD_ENDS: dict[str, tuple[str, ...]] = {
    "decode": ("drain_ack", "prefill_gone"),
    "prefill": ("writes_done", "ran_out"),
}
POLL_RESULTS = ("ok", "unhardened", "unreadable")
STOPS = ("room_failed", "send_deadline")  # why a split send made no more calls (H6)
TAG_OPS = ("stamp", "allocate", "check", "release")  # H8's operations (runtime/page_tags/rows.py)
ENTRY_BUCKETS = (1, 8, 64, 256, 512, 1024, 2048, 4096)
BYTE_BUCKETS = tuple(float(1 << s) for s in range(12, 31, 3))  # 4 KiB .. 1 GiB
SECONDS_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
OP_SECONDS_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.025, 0.1)  # 10 us .. 100 ms

# name: (kind, help, labels[, buckets]); kind "info" is a gauge one process sets to 1
# (its maximum across processes is served: no second writer can make it 2)
SPECS: dict[str, tuple[Any, ...]] = {
    "requests_refused_total": ("counter", "Requests a hardening item refused or ended, by id, role and reason.",
                               ("id", "role", "reason")),
    "holds_started_total": ("counter", "H5 holds of KV pages begun (decode: past the release timeout without a "
                                       "drain ack; prefill: source pages a failed transfer still reads).", ("role",)),
    "holds_ended_total": ("counter", "H5 holds of KV pages ended, by how.", ("role", "ended_by")),
    "hold_seconds": ("histogram", "How long a prefill source hold lasted.", ("role",), SECONDS_BUCKETS),
    "rooms_held": ("gauge", "Rooms whose KV pages an H5 hold keeps now.", ("role",)),
    "transfer_call_entries": ("histogram", "Entries per bounded Mooncake transfer call (H6).", (), ENTRY_BUCKETS),
    "transfer_call_bytes": ("histogram", "Bytes per bounded Mooncake transfer call (H6).", (), BYTE_BUCKETS),
    "transfer_sends_stopped_total": ("counter", "Split sends that made no more calls (H6), by why.", ("reason",)),
    "outcome_followers": ("gauge", "Prefill outcome routes this decode follows (H4).", ()),
    "outcome_polls_total": ("counter", "Polls of a prefill's outcome route (H4), by result.", ("result",)),
    "page_tag_op_seconds": ("histogram", "Wall time of one H8 tag operation, while its cost is metered.",
                            ("role", "op"), OP_SECONDS_BUCKETS),
    "metric_errors_total": ("counter", "Writes of a hardening metric that failed (the event went uncounted), "
                                       "by metric (its name after sglang_hardened_).", ("metric",)),
    # kind "health": a gauge each process sets, the lowest served (a failed process's 0 wins)
    "metrics_healthy": ("health", "1 while every hardening metric write of every process of this server has "
                                  "succeeded; 0 from a process's first failed write until the server restarts.", ()),
    # one series per server, its labels from the build's own manifest (never from a request)
    "build_info": ("info", "The hardened build this server runs (always 1).",
                   ("version", "base", "series_revision", "tool_version", "hardening_ids")),
}
ERRORS = "metric_errors_total"  # its label values are this table's names: a fixed list too
HEALTH = "metrics_healthy"

_metrics: dict[str, Any] = {}
_lock = threading.Lock()
_failed: set[str] = set()  # metrics a write has failed for in this process: each logged once


def enabled() -> bool:
    """Whether this server serves metrics (SGLang set up multiprocess mode)."""
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ


def family(name: str) -> str:
    """The family a scrape shows for SPECS' ``name`` (a counter's samples add ``_total`` back,
    a histogram's ``_bucket``, ``_sum`` and ``_count``)."""
    return f"{PREFIX}_{name.removesuffix('_total')}" if SPECS[name][0] == "counter" else f"{PREFIX}_{name}"


def _metric(name: str) -> Any:
    """The process's metric ``name``, made at its first use (a failure leaves it to be made at
    the next: prometheus_client registers a metric only once its storage is set up)."""
    with _lock:
        if name not in _metrics:
            import prometheus_client as pc

            kind, help_text, labels, *buckets = SPECS[name]
            if kind == "counter":
                _metrics[name] = pc.Counter(family(name), help_text, labels)
            elif kind == "gauge":
                _metrics[name] = pc.Gauge(family(name), help_text, labels, multiprocess_mode="livesum")
            elif kind == "info":
                _metrics[name] = pc.Gauge(family(name), help_text, labels, multiprocess_mode="max")
            elif kind == "health":
                _metrics[name] = pc.Gauge(family(name), help_text, labels, multiprocess_mode="min")
            else:
                _metrics[name] = pc.Histogram(family(name), help_text, labels, buckets=buckets[0])
        return _metrics[name]


def _write(name: str, op: str, value: float, labels: Mapping[str, str]) -> None:
    """``op`` (inc, observe, set) on metric ``name``. Counting runs before the hardening action it
    counts (a release, an abort), so a write that fails (its mmap file, a full disk) never
    raises: it is counted in ERRORS, HEALTH drops to 0 for this process (a gauge, in another
    file than the counters', so it can say so when the counters' file is the one that failed),
    its first failure is logged, and the next event tries again."""
    if not enabled():
        return
    try:
        metric = _metric(name)
        getattr(metric.labels(**labels) if labels else metric, op)(value)
    except Exception as e:  # noqa: BLE001 - metrics never fail a request
        with _lock:
            first = name not in _failed
            _failed.add(name)
        if first:
            log.warning("sglang-hardened: metric %s_%s could not be written in this process (each such write "
                        "is counted in %s_%s): %s", PREFIX, name, PREFIX, ERRORS, e)
        if name not in (ERRORS, HEALTH):
            _write(ERRORS, "inc", 1, {"metric": name})
        if name != HEALTH:
            _write(HEALTH, "set", 0, {})


def _inc(name: str, amount: float = 1, **labels: str) -> None:
    _write(name, "inc", amount, labels)


def _observe(name: str, value: float, **labels: str) -> None:
    _write(name, "observe", value, labels)


def _checked(value: str, allowed: tuple[str, ...]) -> str:
    """A label value from its fixed list, or "other": a new call site's typo must not grow the
    series, and nothing but the list's words may reach a label."""
    return value if value in allowed else "other"


def listed(name: str) -> list[dict[str, str]]:
    """Every label set the fixed lists allow counter or gauge ``name``: what ``at_start`` zeroes."""
    if name == "requests_refused_total":
        return [{"id": hid, "role": role, "reason": reason}
                for hid, by_role in REFUSALS.items() for role, reasons in by_role.items() for reason in reasons]
    if name == "holds_ended_total":
        return [{"role": role, "ended_by": how} for role, hows in HOLD_ENDS.items() for how in hows]
    labels = SPECS[name][2]
    if not labels:
        return [{}]
    words = {"holds_started_total": HOLD_ENDS, "rooms_held": HOLD_ENDS, "transfer_sends_stopped_total": STOPS,
             "outcome_polls_total": POLL_RESULTS, ERRORS: SPECS}[name]
    return [{labels[0]: word} for word in words]


def at_start(build: Mapping[str, Any] | None) -> None:
    """Seam, once per server as it starts (``identity.log_startup``, in the HTTP server's process
    once SGLang set up multiprocess mode): each counter's and gauge's listed series at 0, so
    an alert on ``increase(...) > 0`` sees the first event (a series born at 1 shows no
    increase), and ``build_info`` from the build's manifest (``build``; None: not a hardened
    sglang, which exports none)."""
    for name, (kind, *_) in SPECS.items():
        if kind in ("counter", "gauge"):
            for labels in listed(name):
                _write(name, "inc", 0, labels)
    with _lock:
        failed = bool(_failed)
    _write(HEALTH, "set", 0 if failed else 1, {})
    if build is not None:
        _write("build_info", "set", 1, {
            "version": build["version"], "base": build["base"], "series_revision": str(build["revision"]),
            "tool_version": build["tool"]["version"], "hardening_ids": ",".join(build["hardening_ids"])})


def health() -> dict[str, Any]:
    """The ``metrics`` field of /server_info: whether this server's hardening metrics are served
    whole, read from the multiprocess folder as its /metrics route reads it (every process's
    HEALTH and ERRORS), and whether the folder still takes writes. A silenced writer shows here
    even where nothing scrapes the server; with the folder gone, /metrics serves none of these."""
    if not enabled():
        return {"enabled": False}
    folder = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    writable = os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)
    try:
        from prometheus_client.multiprocess import MultiProcessCollector

        samples = [s for m in MultiProcessCollector(None, path=folder).collect() for s in m.samples]
    except Exception as e:  # noqa: BLE001 - a report, never a failed route
        return {"enabled": True, "healthy": False, "folder_writable": writable, "unreadable": str(e)[:200]}
    lowest = [s.value for s in samples if s.name == family(HEALTH)]
    failed = {s.labels["metric"]: int(s.value) for s in samples if s.name == f"{family(ERRORS)}_total" and s.value}
    return {"enabled": True, "healthy": writable and lowest == [1.0] and not failed, "folder_writable": writable,
            "failed_writes": failed}


def refused(hid: str, role: str, reason: str) -> None:
    """Count a request refused or ended by ``hid`` on ``role`` for ``reason`` (REFUSALS)."""
    hid = _checked(hid, tuple(REFUSALS))
    roles = REFUSALS.get(hid, {})
    role = _checked(role, tuple(roles))
    _inc("requests_refused_total", id=hid, role=role, reason=_checked(reason, roles.get(role, ())))


def hold_started(role: str) -> None:
    """Count an H5 hold begun on ``role``; it holds its room's pages until ``hold_ended``."""
    role = _checked(role, ROLES)
    _inc("holds_started_total", role=role)
    _inc("rooms_held", role=role)


def hold_ended(role: str, ended_by: str, seconds: float | None = None) -> None:
    """Count an H5 hold on ``role`` ended (HOLD_ENDS), and how long it lasted where known."""
    role = _checked(role, ROLES)
    _inc("holds_ended_total", role=role, ended_by=_checked(ended_by, HOLD_ENDS.get(role, ())))
    _inc("rooms_held", -1, role=role)
    if seconds is not None:
        _observe("hold_seconds", seconds, role=role)


def transfer_call(entries: int, nbytes: int) -> None:
    """Observe one bounded Mooncake transfer call (H6): its entries and bytes."""
    _observe("transfer_call_entries", entries)
    _observe("transfer_call_bytes", nbytes)


def send_stopped(reason: str) -> None:
    """Count a split send stopped between its calls (H6) for ``reason`` (STOPS)."""
    _inc("transfer_sends_stopped_total", reason=_checked(reason, STOPS))


def following(delta: int) -> None:
    """A prefill outcome route followed (+1) or dropped (-1) by this decode (H4)."""
    _inc("outcome_followers", delta)


def polled(result: str) -> None:
    """Count one poll of a prefill's outcome route (H4) by result (POLL_RESULTS)."""
    _inc("outcome_polls_total", result=_checked(result, POLL_RESULTS))


def tag_op(role: str, op: str, seconds: float) -> None:
    """Observe one H8 tag operation's wall time (TAG_OPS) on ``role``: only while H8's cost is
    metered (runtime/page_tags/cost.py), whose clocks it reads, so an unmetered check costs nothing."""
    _observe("page_tag_op_seconds", seconds, role=_checked(role, ROLES), op=_checked(op, TAG_OPS))
