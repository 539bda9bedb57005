"""The runtime's metrics (runtime/metrics.py) in prometheus_client's multiprocess mode, as
SGLang's /metrics route reads them: samples from several processes summed, names under
sglang_hardened_, label values only from the fixed lists, nothing at all without the mode."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from sglang_hardened.runtime import metrics

RUNTIME = Path(metrics.__file__).parent

# Two processes (as SGLang's scheduler and HTTP server) count events, one with labels that are
# not on the lists (a room number, a prompt); then the route's collector reads the folder.
EMIT = """
import os, sys
from sglang_hardened.runtime import metrics
metrics.refused("H3", "decode", "prompt_length_differs")
metrics.refused("H8", "decode", "tag_mismatch")
metrics.refused("H3", "decode", sys.argv[1])
metrics.hold_started("decode"); metrics.hold_ended("decode", "drain_ack")
metrics.hold_started("prefill"); metrics.hold_ended("prefill", "writes_done", 1.5)
metrics.hold_started("prefill")
metrics.transfer_call(300, 300 * 65536)
metrics.send_stopped("room_failed")
metrics.following(+1)
metrics.polled("ok")
from sglang_hardened.runtime.page_tags_cost import CostMeter
for every in (2, 0):  # H8's cost metered, then not: only the metered check is observed
    meter = CostMeter("decode", closing_op="release", unit="request", every=every)
    meter.add("check", meter.start(), 1, 4)
"""
COLLECT = """
import json
from prometheus_client import CollectorRegistry, multiprocess
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(json.dumps([[s.name, s.labels, s.value] for m in registry.collect() for s in m.samples]))
"""


def _run(code: str, *args: str, env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True,
                          env=env).stdout


def test_samples_from_every_process_are_summed_and_carry_only_listed_labels(tmp_path):
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(RUNTIME.parents[1])}
    _run(EMIT, "room 4711: the secret prompt", env=env)
    _run(EMIT, "prompt_length_differs", env=env)
    samples = json.loads(_run(COLLECT, env=env))
    value = {(name, tuple(sorted(labels.items()))): v for name, labels, v in samples}

    def got(name: str, **labels: str) -> float:
        return value.get((f"sglang_hardened_{name}", tuple(sorted(labels.items()))), 0.0)

    assert got("requests_refused_total", id="H3", role="decode", reason="prompt_length_differs") == 3
    assert got("requests_refused_total", id="H3", role="decode", reason="other") == 1  # not the prompt
    assert got("requests_refused_total", id="H8", role="decode", reason="tag_mismatch") == 2
    assert got("holds_started_total", role="prefill") == 4
    assert got("holds_ended_total", role="decode", ended_by="drain_ack") == 2
    assert got("rooms_held", role="prefill") == 2 and got("rooms_held", role="decode") == 0  # live sum
    assert got("hold_seconds_sum", role="prefill") == 3.0
    assert got("transfer_call_entries_bucket", le="512.0") == 2 and got("transfer_call_entries_bucket", le="256.0") == 0
    assert got("transfer_sends_stopped_total", reason="room_failed") == 2
    assert got("outcome_polls_total", result="ok") == 2
    assert got("page_tag_op_seconds_count", role="decode", op="check") == 2

    allowed = {*metrics.ROLES, *metrics.STOPS, *metrics.POLL_RESULTS, *metrics.REASONS, *metrics.TAG_OPS, "other",
               *(r for rs in (*metrics.REASONS.values(), *metrics.HOLD_ENDS.values()) for r in rs)}
    for name, labels, _ in samples:
        assert name.startswith("sglang_hardened_"), name
        for key, label in labels.items():
            assert key == "le" or label in allowed, (name, key, label)


def test_nothing_is_imported_or_written_without_metrics(tmp_path):
    code = ("import sys; from sglang_hardened.runtime import metrics; metrics.refused('H3', 'decode', "
            "'sender_shortfall'); metrics.transfer_call(1, 1); print('prometheus_client' in sys.modules)")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(RUNTIME.parents[1])}
    assert _run(code, env=env).strip() == "False"


def _calls(name: str) -> list[ast.Call]:
    found = []
    for path in RUNTIME.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "metrics":
                found.append(node)
    return found


def test_every_call_site_names_a_listed_reason():
    """A reason that is not on its list would be counted as "other": every call site in the
    runtime spells its id, role and reason as listed words (literals, or a choice of them)."""

    def words(node: ast.expr) -> set[str]:
        if isinstance(node, ast.Constant):
            return {node.value}
        if isinstance(node, ast.IfExp):
            return words(node.body) | words(node.orelse)
        if isinstance(node, ast.Name):  # a variable bound from a tuple of literals nearby
            return {"<variable>"}
        return {"<expression>"}

    refusals = _calls("refused")
    assert {words(c.args[0]).pop() for c in refusals} >= {"H3", "H4", "H7", "H8", "H11", "H12"}
    for call in refusals:
        hid, role, reason = call.args
        (hid_word,) = words(hid)
        assert words(reason) <= set(metrics.REASONS[hid_word]), ast.unparse(call)
        assert words(role) <= {*metrics.ROLES, "<expression>"}, ast.unparse(call)  # H11: the server's own mode
    for call in _calls("hold_ended"):
        role, how = (words(a).pop() for a in call.args[:2])
        assert how in metrics.HOLD_ENDS[role], ast.unparse(call)
    for call in _calls("polled"):
        assert words(call.args[0]) <= set(metrics.POLL_RESULTS), ast.unparse(call)


def test_a_metric_that_cannot_be_written_never_fails_the_caller(tmp_path):
    """Each count runs before the hardening action it counts (a release, an abort): with the
    multiprocess folder gone (its files cannot be made), every call returns, each metric's
    failure is logged once however often it recurs, and the caller goes on."""
    code = ("from sglang_hardened.runtime import metrics\n"
            "for _ in range(2):\n"
            "    metrics.refused('H3', 'decode', 'sender_shortfall'); metrics.hold_started('prefill')\n"
            "    metrics.hold_ended('prefill', 'writes_done', 1.0); metrics.transfer_call(1, 1)\n"
            "    metrics.send_stopped('room_failed'); metrics.following(1); metrics.polled('ok')\n"
            "    metrics.tag_op('decode', 'check', 1e-5)\n"
            "print('went on')")
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "gone"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(RUNTIME.parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "went on\n"
    logged = re.findall(r"metric sglang_hardened_(\w+) could not be written", done.stderr)
    assert sorted(logged) == sorted(metrics.SPECS), done.stderr  # every one touched, its error counter too


def test_a_write_error_silences_only_what_failed_and_is_counted(tmp_path):
    """Finding (#44): one failed write turned every hardening metric off for the process's
    life, and nothing on /metrics said so. The process's histogram file is made unwritable (a
    folder where prometheus_client would map it): counters and gauges go on counting, and each
    lost histogram write is counted in sglang_hardened_metric_errors_total by its metric."""
    code = ("import os\n"
            "from sglang_hardened.runtime import metrics\n"
            "blocked = os.path.join(os.environ['PROMETHEUS_MULTIPROC_DIR'], f'histogram_{os.getpid()}.db')\n"
            "os.mkdir(blocked)\n"
            "metrics.transfer_call(300, 300 * 65536)\n"
            "metrics.refused('H3', 'decode', 'prompt_length_differs')\n"
            "metrics.hold_started('prefill'); metrics.hold_ended('prefill', 'writes_done', 1.5)\n"
            "metrics.transfer_call(300, 300 * 65536)\n"
            "os.rmdir(blocked)  # the collector reads every *.db it finds\n")
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(RUNTIME.parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    value = {(name, tuple(sorted(labels.items()))): v for name, labels, v in json.loads(_run(COLLECT, env=env))}

    def got(name: str, **labels: str) -> float:
        return value.get((f"sglang_hardened_{name}", tuple(sorted(labels.items()))), 0.0)

    assert got("requests_refused_total", id="H3", role="decode", reason="prompt_length_differs") == 1
    assert got("holds_ended_total", role="prefill", ended_by="writes_done") == 1
    assert got("rooms_held", role="prefill") == 0
    assert got("metric_errors_total", metric="transfer_call_entries") == 2
    assert got("metric_errors_total", metric="transfer_call_bytes") == 2
    assert got("metric_errors_total", metric="hold_seconds") == 1
    logged = re.findall(r"metric sglang_hardened_(\w+) could not be written", done.stderr)
    assert sorted(logged) == ["hold_seconds", "transfer_call_bytes", "transfer_call_entries"], done.stderr
