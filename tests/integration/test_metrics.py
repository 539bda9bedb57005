"""The runtime's metrics (runtime/metrics.py) in prometheus_client's multiprocess mode, as
SGLang's /metrics route reads them: samples from several processes summed, names under
sglang_hardened_, label values only from the fixed lists, nothing at all without the mode;
every listed series at 0 and the build's info from the server's start."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from sglang_hardened.pipeline.lock import load_lock
from sglang_hardened.pipeline.manifest import build_manifest
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.pipeline.stamp import hardened_version
from sglang_hardened.runtime import metrics
from tests.harness import REPO

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
from sglang_hardened.runtime.page_tags.cost import CostMeter
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


def _env(folder: Path, *path: Path) -> dict[str, str]:
    """A process's environment in SGLang's multiprocess mode (``folder``), the runtime importable."""
    return {"PROMETHEUS_MULTIPROC_DIR": str(folder), "PATH": "/usr/bin:/bin",
            "PYTHONPATH": ":".join(map(str, (*path, RUNTIME.parents[1])))}


def _served(env: dict[str, str]) -> dict[tuple[str, tuple], float]:
    """What /metrics serves from the folder: each sample's value by (name, sorted labels)."""
    return {(name, tuple(sorted(labels.items()))): v for name, labels, v in json.loads(_run(COLLECT, env=env))}


def test_samples_from_every_process_are_summed_and_carry_only_listed_labels(tmp_path):
    env = _env(tmp_path)
    _run(EMIT, "room 4711: the secret prompt", env=env)
    _run(EMIT, "prompt_length_differs", env=env)
    samples = json.loads(_run(COLLECT, env=env))
    value = _served(env)

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

    allowed = {*metrics.ROLES, *metrics.STOPS, *metrics.POLL_RESULTS, *metrics.REFUSALS, *metrics.TAG_OPS, "other",
               *(r for by_role in metrics.REFUSALS.values() for rs in by_role.values() for r in rs),
               *(r for rs in metrics.HOLD_ENDS.values() for r in rs)}
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
    for path in RUNTIME.rglob("*.py"):
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
        by_role = metrics.REFUSALS[hid_word]
        roles = set(by_role) if words(role) == {"<expression>"} else words(role)  # H11: the server's own mode
        assert roles <= set(by_role), ast.unparse(call)
        assert all(words(reason) <= set(by_role[r]) for r in roles), ast.unparse(call)
    for call in _calls("hold_ended"):
        role, how = (words(a).pop() for a in call.args[:2])
        assert how in metrics.HOLD_ENDS[role], ast.unparse(call)
    for call in _calls("polled"):
        assert words(call.args[0]) <= set(metrics.POLL_RESULTS), ast.unparse(call)


def test_a_metric_that_cannot_be_written_never_fails_the_caller(tmp_path):
    """Each count runs before the hardening action it counts (a release, an abort): with the
    multiprocess folder gone (its files cannot be made), every call returns, each metric's
    failure is logged once however often it recurs, and the caller goes on."""
    base = list(load_lock(REPO / "patches"))[-1]
    series = load_series(REPO / "patches", base)
    build = build_manifest(load_lock(REPO / "patches")[base], series, hardened_version(base, series.revision))
    code = ("from sglang_hardened.runtime import metrics\n"
            f"metrics.at_start({build!r})\n"
            "for _ in range(2):\n"
            "    metrics.refused('H3', 'prefill', 'sender_shortfall'); metrics.hold_started('prefill')\n"
            "    metrics.hold_ended('prefill', 'writes_done', 1.0); metrics.transfer_call(1, 1)\n"
            "    metrics.send_stopped('room_failed'); metrics.following(1); metrics.polled('ok')\n"
            "    metrics.tag_op('decode', 'check', 1e-5)\n"
            "print('went on')")
    env = _env(tmp_path / "gone")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "went on\n"
    logged = re.findall(r"metric sglang_hardened_(\w+) could not be written", done.stderr)
    assert sorted(logged) == sorted(metrics.SPECS), done.stderr  # every one touched, its error counter too


def test_a_write_error_silences_only_what_failed_and_is_counted(tmp_path):
    """Finding (review): one failed write turned every hardening metric off for the process's
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
    env = _env(tmp_path)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    value = _served(env)

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


HEALTH = """
import json
from sglang_hardened.runtime import metrics
print(json.dumps(metrics.health()))
"""


def test_a_silenced_writer_shows_in_the_health_gauge_and_server_info(tmp_path):
    """Finding: a metrics writer that failed left no mark an operator could see before the
    undercount itself. The server starts healthy (gauge 1, /server_info's ``metrics`` says so);
    then a scheduler-like process's counter file cannot be written: its events go uncounted
    and so does their error count (the same file), but the health gauge, in another file, drops
    to 0 for the whole server and /server_info's field turns unhealthy."""
    env = _env(tmp_path)
    _run(START, env=env)
    assert _served(env)[("sglang_hardened_metrics_healthy", ())] == 1
    assert json.loads(_run(HEALTH, env=env)) == {"enabled": True, "healthy": True, "folder_writable": True,
                                                 "failed_writes": {}}
    blocked = ("import os\n"
               "from sglang_hardened.runtime import metrics\n"
               "counters = os.path.join(os.environ['PROMETHEUS_MULTIPROC_DIR'], f'counter_{os.getpid()}.db')\n"
               "os.mkdir(counters)\n"
               "metrics.refused('H8', 'decode', 'tag_mismatch')\n"
               "os.rmdir(counters)\n")
    subprocess.run([sys.executable, "-c", blocked], check=True, capture_output=True, env=env)
    value = _served(env)
    assert value[("sglang_hardened_metrics_healthy", ())] == 0
    tag_mismatch = ("sglang_hardened_requests_refused_total", (("id", "H8"), ("reason", "tag_mismatch"), ("role", "decode")))
    assert value[tag_mismatch] == 0  # uncounted: what the gauge is there to say
    assert json.loads(_run(HEALTH, env=env))["healthy"] is False
    gone = json.loads(_run(HEALTH, env={**env, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "gone")}))
    assert gone["healthy"] is False and gone["folder_writable"] is False and "not a directory" in gone["unreadable"]
    assert json.loads(_run(HEALTH, env={k: v for k, v in env.items() if k != "PROMETHEUS_MULTIPROC_DIR"})) == {
        "enabled": False}


# the H0 seam, as the HTTP server calls it once it has started its processes
START = "from sglang_hardened.runtime import identity; identity.log_startup()"


def _documented_refusals() -> set[tuple[str, str, str]]:
    """(id, role, reason) of docs/metrics.md's refusal table: what an operator writes alerts for."""
    table = (REPO / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\| (H\d+) \| ([a-z, ]+) \| ((?:`\w+`(?:, )?)+) \|", table, re.M)
    return {(hid, role, reason) for hid, roles, reasons in rows
            for role in roles.split(", ") for reason in re.findall(r"`(\w+)`", reasons)}


def test_every_listed_series_is_served_at_zero_from_the_servers_start(tmp_path):
    """Finding (review): a counter appeared at its first event, and Prometheus' ``increase`` has no
    sample before a series' first to rise from, so ``increase(...[5m]) > 0`` missed the first H8
    ``tag_mismatch`` (which pages). At H0's start-up seam every documented refusal, and every
    listed series of each counter and gauge, is served at 0; an event in another process then
    adds to it. No build_info without a hardened sglang installed (here: none at all)."""
    env = _env(tmp_path)
    _run(START, env=env)
    value = _served(env)
    refused = {(dict(labels)["id"], dict(labels)["role"], dict(labels)["reason"])
               for name, labels in value if name == "sglang_hardened_requests_refused_total"}
    assert refused == _documented_refusals()
    assert {v for (name, _), v in value.items() if name != "sglang_hardened_metrics_healthy"} == {0.0}
    assert value[("sglang_hardened_metrics_healthy", ())] == 1
    for name, (kind, *_) in metrics.SPECS.items():
        if kind in ("counter", "gauge"):
            sample = metrics.family(name) + ("_total" if kind == "counter" else "")
            served = {labels for served_name, labels in value if served_name == sample}
            assert served == {tuple(sorted(labels.items())) for labels in metrics.listed(name)}, name
    assert {dict(labels)["metric"] for name, labels in value if name == "sglang_hardened_metric_errors_total"} \
        == set(metrics.SPECS)
    assert len(value) < 100, "bounded: a few dozen series per server"
    assert not any(name == "sglang_hardened_build_info" for name, _ in value)

    _run("from sglang_hardened.runtime import metrics; metrics.refused('H8', 'decode', 'tag_mismatch')", env=env)
    tag_mismatch = ("sglang_hardened_requests_refused_total",
                    (("id", "H8"), ("reason", "tag_mismatch"), ("role", "decode")))
    assert _served(env)[tag_mismatch] == 1


def test_build_info_names_the_build_a_server_runs(built, tmp_path):
    """Finding (review): nothing on /metrics told a hardened server from an upstream one (which
    serves SGLang's own ``sglang:*`` families too), so Prometheus alone could not find an
    unhardened or mixed fleet. A server whose sglang is the newest base's hardened wheel (its
    dist-info, manifest and all, as pip installs it) serves build_info = 1 naming that build."""
    results, _ = built
    base = max(results, key=lambda b: tuple(map(int, b.split("."))))
    result = results[base]
    site = tmp_path / "site"
    with zipfile.ZipFile(result.wheel) as wheel:
        wheel.extractall(site, [n for n in wheel.namelist() if n.startswith(f"sglang-{result.version}.dist-info/")])
    env = _env(tmp_path / "metrics", site)
    (tmp_path / "metrics").mkdir()
    _run(START, env=env)
    series = load_series(REPO / "patches", base)
    info = {labels: v for (name, labels), v in _served(env).items() if name == "sglang_hardened_build_info"}
    assert info == {tuple(sorted({"version": result.version, "base": base, "series_revision": str(series.revision),
                                  "tool_version": result.manifest["tool"]["version"],
                                  "hardening_ids": ",".join(series.hardening_ids)}.items())): 1.0}
