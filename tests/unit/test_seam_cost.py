"""The per-seam cost switch (runtime/seam_cost.py): off, the seams are the original functions;
on, every call is counted and timed on its thread and passes its result or exception through."""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import threading
import time
from pathlib import Path

import pytest

from sglang_hardened.common.knobs import SEAM_COST_DIR
from sglang_hardened.common.paths import patches_dir
from sglang_hardened.pipeline.seams import runtime_seams
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.runtime import abort_match, metrics, parallel_sampling, seam_cost
from sglang_hardened.sandbox.env import bases
from tests.harness import REPO

RUNTIME = REPO / "sglang_hardened" / "runtime"


@pytest.fixture(scope="module")
def every_seam() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for base in bases():
        for seam, ids in runtime_seams((p.hardening_id, p.diff)
                                       for p in load_series(patches_dir(), base).patches).items():
            found.setdefault(seam, set()).update(ids)
    return found


def _definition(module: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """Where ``module.name`` is defined in the runtime's source (``module`` dotted under runtime),
    following relative imports (``from .x import name``, ``from ..y import name``)."""
    package = module.split(".")[:-1]
    for node in ast.parse((RUNTIME / f"{module.replace('.', '/')}.py").read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        if isinstance(node, ast.ImportFrom) and node.level and any(a.name == name for a in node.names):
            return _definition(".".join([*package[:len(package) + 1 - node.level], node.module or ""]), name)
    return None


def test_every_seam_the_patches_call_is_a_function_its_wrapper_times_whole(every_seam):
    """A coroutine or generator would be timed only while it is made; a context manager (H12's)
    is timed at its making, entry and exit."""
    assert len(every_seam) > 40 and {"abort_match.aborts", "page_tags.seams.allocate"} <= set(every_seam)
    for seam in [*every_seam, seam_cost.METRICS_SEAM]:
        found = _definition(*seam.rsplit(".", 1))
        assert isinstance(found, ast.FunctionDef), seam
        decorators = [ast.unparse(d) for d in found.decorator_list]
        generator = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(found))
        assert decorators == (["contextlib.contextmanager"] if generator else []), seam


def test_a_context_manager_seam_times_its_entry_and_exit_not_the_body_and_keeps_its_exception():
    @contextlib.contextmanager
    def refusing():
        try:
            yield "entered"
        except TypeError as e:
            raise ValueError("refused") from e

    seam = seam_cost.timed("test.context", refusing)
    main = threading.current_thread() is threading.main_thread()
    with seam() as value:
        assert value == "entered"
        _busy(5_000_000)  # upstream's own work: not the seam's
    with pytest.raises(ValueError, match="refused"), seam():
        raise TypeError("a bad field")
    calls, ns = seam_cost.totals()["test.context", main]
    assert calls == 2 and ns < 2_000_000


def test_off_wraps_nothing_and_starts_nothing(every_seam):
    """Unset, the seams are the original functions, so the switch costs a call nothing."""
    threads = threading.active_count()
    assert seam_cost.install({}) is None and threading.active_count() == threads
    for seam in [*every_seam, seam_cost.METRICS_SEAM]:
        module_name, name = seam.rsplit(".", 1)
        try:
            module = importlib.import_module(f"sglang_hardened.runtime.{module_name}")
        except ModuleNotFoundError:  # torch's modules: their seams are checked where torch is
            continue
        fn = getattr(module, name)
        code = getattr(fn, "__wrapped__", fn).__code__  # a context manager's: its generator function's
        assert not hasattr(fn, seam_cost.WRAPPED) and code.co_filename != seam_cost.__file__, seam
        assert RUNTIME.resolve() in Path(code.co_filename).parents, seam  # its own or a runtime module's


def _busy(ns: int) -> None:
    end = time.thread_time_ns() + ns
    while time.thread_time_ns() < end:
        pass


def test_a_timed_call_counts_its_own_time_less_the_timed_calls_it_makes():
    inner = seam_cost.timed("test.inner", _busy)

    def outer_work() -> str:
        _busy(2_000_000)
        inner(3_000_000)
        return "done"

    outer = seam_cost.timed("test.outer", outer_work)
    assert outer() == "done"
    sums = seam_cost.totals()
    main = threading.current_thread() is threading.main_thread()
    (outer_calls, outer_ns), (inner_calls, inner_ns) = sums["test.outer", main], sums["test.inner", main]
    assert outer_calls == inner_calls == 1
    assert 2_000_000 <= outer_ns < 3_000_000 and 3_000_000 <= inner_ns < 4_000_000


def test_upstreams_own_work_a_seam_is_handed_is_not_the_seams():
    """H6's seam is handed the engine's write, H8's the message parser: their time is upstream's."""

    class Engine:
        def write(self, ns: int) -> int:
            _busy(ns)
            return 0

    def bounded(write, ns: int) -> int:
        _busy(1_000_000)
        return write(ns)

    seam = seam_cost.timed("test.bounded", bounded)
    assert seam(Engine().write, 4_000_000) == 0
    calls, ns = seam_cost.totals()["test.bounded", threading.current_thread() is threading.main_thread()]
    assert calls == 1 and 1_000_000 <= ns < 2_000_000


def test_on_times_every_listed_seam_and_metric_writes_and_passes_exceptions(tmp_path, monkeypatch):
    for module, name in ((abort_match, "aborts"), (parallel_sampling, "refuse_in_pd"), (metrics, "_write")):
        monkeypatch.setattr(module, name, getattr(module, name))  # put back the original afterwards
    monkeypatch.setattr(seam_cost, "_report", None)
    (tmp_path / seam_cost.SEAMS_FILE).write_text(json.dumps({"abort_match.aborts": ["H15"],
                                                             "parallel_sampling.refuse_in_pd": ["H11"]}))
    report = seam_cost.install({SEAM_COST_DIR.name: str(tmp_path)})
    assert report is not None and getattr(abort_match.aborts, seam_cost.WRAPPED) == "abort_match.aborts"
    assert [abort_match.aborts("rid-1", "rid-1"), abort_match.aborts("rid-12", "rid-1")] == [True, False]
    with pytest.raises(ValueError, match="H11"):
        parallel_sampling.refuse_in_pd("prefill")  # refused: its metric write, then the exception
    parallel_sampling.refuse_in_pd("null")
    report.write()
    written = json.loads(report.path.read_text())
    calls = {s["seam"]: (s["calls"], s["ids"]) for s in written["seams"]}
    assert calls["abort_match.aborts"] == (2, ["H15"]) and calls["parallel_sampling.refuse_in_pd"] == (2, ["H11"])
    assert calls[seam_cost.METRICS_SEAM] == (1, ["metrics"])
    assert written["main_cpu_ns"] > 0 and written["process_cpu_ns"] >= written["main_cpu_ns"]
    assert 0 < written["timer"]["recorded_ns"] < 50_000 and 0 <= written["timer"]["added_ns"] < 50_000


def test_a_switch_without_its_list_stops_the_process_naming_it(tmp_path):
    with pytest.raises(ValueError, match=f"{SEAM_COST_DIR.name}=.*no readable seams.json"):
        seam_cost.install({SEAM_COST_DIR.name: str(tmp_path)})
