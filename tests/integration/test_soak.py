"""The soak's parts that need no cluster: its plan (reproducible, and refusing bad rates and
names), its judge (each verdict), its report, its read of the growing ledger, its aim at one
server of several and its rolling restart (real process groups stand in for the servers), and
its command's bad input. tests/e2e/test_fault_matrix.py and test_soak_2x2.py run it on real clusters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

from sglang_hardened.common.knobs import CACHE
from sglang_hardened.sandbox.cluster import Cluster, ClusterParams, Proc, signal_group
from sglang_hardened.sandbox.env import SandboxError
from sglang_hardened.sandbox.soak.catalogue import Catalogue, Expected, Prompt, fitting_lengths
from sglang_hardened.sandbox.soak.faults import Injector, RestartFailed, _OpenWrites, group_pids
from sglang_hardened.sandbox.soak.judge import judge, names_a_cause
from sglang_hardened.sandbox.soak.plan import FAULTS, SoakPlan, Step
from sglang_hardened.sandbox.soak.report import SoakReport
from sglang_hardened.sandbox.soak.run import _end_checks
from sglang_hardened.sandbox.soak.traffic import Sent, body_of

PLAN = SoakPlan(release_timeout_s=8.0, seed=3)
FIT = [Prompt("a b c", 3, 4), Prompt("d e f g", 4, 5)]
CAT = Catalogue(FIT, [Prompt("long " * 300, 300, 4)], [Prompt("longer " * 900, 900, 4)],
                {"a b c": Expected(200, (1, 2, 3, 4)), "d e f g": Expected(200, (5, 6, 7, 8, 9)),
                 "long " * 300: Expected(400, None), "longer " * 900: Expected(400, None)})


def _step(kind: str, fault: str | None = None, prompt: int = 0, variant: int = 1) -> Step:
    return Step(0, 0, kind, prompt, fault, 0.5, 4.0, variant)


def _sent(status: int | None, outputs=None, body: str = "", seconds: float = 1.0, hung_up: bool = False) -> Sent:
    return Sent(status, outputs, body, 0.0, seconds, hung_up)


def test_a_seed_draws_the_same_schedule_and_another_seed_a_different_one():
    again = SoakPlan(release_timeout_s=8.0, seed=3)
    steps = [PLAN.step(c, i) for c in range(4) for i in range(50)]
    assert steps == [again.step(c, i) for c in range(4) for i in range(50)]
    assert steps != [replace(PLAN, seed=4).step(c, i) for c in range(4) for i in range(50)]


def test_rates_are_shares_of_requests_and_every_fault_and_kind_is_drawn():
    plan = SoakPlan(release_timeout_s=8.0, rates={name: 0.1 for name in FAULTS})
    steps = [plan.step(c, i) for c in range(8) for i in range(500)]
    for name in FAULTS:
        share = sum(s.fault == name for s in steps) / len(steps)
        assert 0.08 < share < 0.12, (name, share)
    assert {s.kind for s in steps} == set(plan.mix)
    aborts = [s for s in steps if s.fault and s.fault.startswith("abort")]
    assert {s.kind for s in aborts} <= {"fits", "stream", "over-pool", "over-limit"}  # an abort names one rid
    stops = [s.stop_s / plan.release_timeout_s for s in steps if s.fault == "stop-decode"]
    assert min(stops) < 0.6 and max(stops) > 1.3  # below and above the release timeout


@pytest.mark.parametrize("change, says", [
    (dict(rates={"reboot": 0.1}), "unknown fault reboot"),
    (dict(rates={"kill-decode": 1.5}), "0..1: kill-decode=1.5"),
    (dict(rates={"kill-decode": -0.1}), "0..1"),
    (dict(rates={"kill-decode": 0.6, "stop-decode": 0.6}), "sum to 1.2"),
    (dict(mix={"poem": 1.0}), "unknown request kind poem"),
    (dict(clients=0), "at least one client"),
])
def test_bad_plans_are_refused_naming_the_cause(change, says):
    with pytest.raises(SandboxError, match=says):
        replace(PLAN, **change).validate()


def test_fitting_lengths_straddle_pages_and_chunks_and_stay_inside_every_limit():
    p = ClusterParams(base="0.5.23", prefill_pool_tokens=1024, context_length=1024, page_size=16, chunked_prefill_size=256)
    lengths = fitting_lengths(p)
    assert {15, 16, 17, 255, 256, 257} <= set(lengths)
    assert max(lengths) < 1024 - 16


@pytest.mark.parametrize("step, sent, calm_at, verdict", [
    (_step("fits"), _sent(200, ((1, 2, 3, 4),)), None, "ok"),
    (_step("fits"), _sent(200, ((1, 2, 3, 5),)), 0.5, "wrong-output"),  # a fault may fail a request, not make it lie
    (_step("n2"), _sent(200, ((1, 2, 3, 4), (1, 2, 3, 4))), None, "ok"),
    (_step("n2"), _sent(200, ((1, 2, 3, 4),)), None, "wrong-output"),
    (_step("batch"), _sent(200, ((1, 2, 3, 4), (5, 6, 7, 8, 9))), None, "ok"),
    (_step("over-pool"), _sent(200, ((1,),)), None, "answered-over-limit"),
    (_step("over-limit"), _sent(400, body='{"error": {"message": "longer than the context"}}'), None, "refused"),
    (_step("fits"), _sent(500, body='{"error": {"message": "KV transfer failed"}}'), None, "failed"),
    (_step("fits"), _sent(500, body="Internal Server Error"), None, "unnamed-error"),
    (_step("fits"), _sent(500, body="Internal Server Error"), 0.5, "failed"),
    (_step("fits"), _sent(None, body="the stream ended before [DONE]"), None, "broken-answer"),
    (_step("fits"), _sent(None, body="connection failed"), 0.5, "failed"),
    (_step("fits"), _sent(200, ((1, 2, 3, 4),), seconds=99.0), None, "hang"),
    (_step("fits"), _sent(200, ((1, 2, 3, 4),), seconds=60.0), 30.0, "ok"),  # stacked stops: the bound runs from the last
    (_step("fits"), _sent(None, body="no answer", seconds=80.0), 30.0, "hang"),
    (_step("fits", "disconnect"), _sent(None, hung_up=True), None, "hung-up"),
    (_step("malformed"), _sent(422, body='{"detail": [{"msg": "JSON decode error"}]}'), None, "refused"),
    (_step("malformed"), _sent(500, body='{"error": "boom"}'), None, "bad-input-5xx"),
    (_step("malformed"), _sent(200, body="{}"), None, "wrong-output"),
])
def test_each_verdict(step, sent, calm_at, verdict):
    assert judge(step, sent, CAT, PLAN.bound_s, calm_at).verdict == verdict


def test_an_error_names_its_cause_only_beyond_its_status_line():
    assert names_a_cause('{"error": {"message": "The input (6600 tokens) is longer"}}')
    assert names_a_cause("upstream prefill refused: pool too small")
    assert not names_a_cause("Internal Server Error")
    assert not names_a_cause('{"error": ""}')
    # the fixed fields around a message are no cause: an empty message in SGLang's shapes
    assert not names_a_cause('{"error": {"message": "", "type": "invalid_request_error", "code": 500}}')
    assert not names_a_cause('{"object": "error", "message": "Internal Server Error", "type": "InternalServerError"}')
    assert not names_a_cause('{"type": "abort", "status_code": 500}')
    assert names_a_cause('{"type": "abort", "message": "sglang-hardened H4: prefill ended the request"}')
    assert names_a_cause('{"detail": "Not Found"}') and names_a_cause('{"error": "prefill refused"}')


def test_request_bodies_per_kind():
    assert json.loads(body_of(_step("stream"), CAT, "r1")) == {
        "text": "a b c", "sampling_params": {"temperature": 0.0, "max_new_tokens": 4}, "stream": True, "rid": "r1"}
    assert "rid" not in json.loads(body_of(_step("n2"), CAT, "r1"))
    assert json.loads(body_of(_step("batch"), CAT, "r1"))["text"] == ["a b c", "d e f g"]
    with pytest.raises(ValueError):
        json.loads(body_of(_step("malformed", variant=2), CAT, "r1"))


def test_the_report_counts_and_names_each_violation():
    report = SoakReport({"base": "0.5.23", "backend": "mooncake", "lb": "mini-lb", "servers": "1x1"}, 3, bound_s=PLAN.bound_s)
    report.outcomes = [judge(_step("fits"), _sent(200, ((1, 2, 3, 4),)), CAT, PLAN.bound_s),
                       judge(_step("over-pool"), _sent(200, ((1,),)), CAT, PLAN.bound_s)]
    report.end_violations = [("page-freed-under-write", "room 7: page 3 freed while its write was in flight")]
    data = report.to_json()
    assert not report.ok and data["outcomes"] == {"ok": 1}
    assert {k: v["count"] for k, v in data["violations"].items()} == {"answered-over-limit": 1, "page-freed-under-write": 1}
    assert "2 violations" in report.table().splitlines()[0]


def test_the_ledger_is_read_as_it_grows(tmp_path):
    ledger = _OpenWrites(tmp_path)
    assert not ledger.any(killed={})
    (tmp_path / "11.jsonl").write_text(json.dumps({"t": 1.0, "ev": "begin", "room": 5, "w": 1, "pages": [1]}) + "\n"
                                       + '{"t": 2.0, "ev": "en')  # a line still being written
    assert ledger.any(killed={})
    with (tmp_path / "11.jsonl").open("a") as f:
        f.write('d", "room": 5, "w": 1}\n')
    assert not ledger.any(killed={})
    # a write whose writer was killed never ends in the ledger: it ended at the kill
    (tmp_path / "12.jsonl").write_text(json.dumps({"t": 3.0, "ev": "begin", "room": 6, "w": 1, "pages": [2]}) + "\n")
    assert ledger.any(killed={"11": 2.5}) and not ledger.any(killed={"12": 3.5})


def test_a_server_that_will_not_restart_stops_the_soak_with_its_reason(tmp_path):
    """A real process group stands in for the killed server; its restart fails."""
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    params = ClusterParams(base="0.5.23", instrument=True)
    cluster = Cluster(params, "t", tmp_path, {r: Proc(r, server.pid if r == "decode" else 0, "", "", 0)
                                              for r in ("prefill", "decode")})
    cluster.instruments.prepare()

    def restart(role: str) -> None:
        raise SandboxError(f"{role} exited during start-up")

    injector = Injector(cluster, replace(PLAN, release_timeout_s=0.1), restart, cluster.instruments)
    injector.fire(Step(0, 0, "fits", 0, "kill-decode", 0.0, 0.0, 0), "r1")
    injector.finish(30)
    assert not group_pids(server.pid)  # killed (and reaped, as the cluster's restart reaps its own)
    assert isinstance(injector.error, RestartFailed) and "decode would not restart" in str(injector.error)
    assert str(server.pid) in injector.killed


def test_a_server_down_at_the_end_is_a_finding_and_the_rest_is_still_judged(tmp_path):
    """A server that died by itself (upstream crashes the soak found): no traceback, a finding."""
    cluster = Cluster(ClusterParams(base="0.5.23", instrument=True), "t", tmp_path,
                      {r: Proc(r, 0, "", "http://127.0.0.1:9", 9) for r in ("prefill", "decode")})  # nothing listens
    cluster.instruments.prepare()
    injector = Injector(cluster, PLAN, lambda role: None, cluster.instruments)
    found = _end_checks(cluster, injector, {"prefill": 0, "decode": 0}, PLAN, began=0.0)
    assert [kind for kind, _ in found] == ["server-down"] and "/v1/loads" in found[0][1]


def test_an_uninstrumented_cluster_is_refused(tmp_path):
    with pytest.raises(SandboxError, match="--instrument"):
        Injector(Cluster(ClusterParams(base="0.5.23"), "t", tmp_path), PLAN, lambda role: None, None)


@pytest.mark.parametrize("args, says", [
    (["--rate", "reboot=0.1"], "unknown fault reboot"),
    (["--rate", "kill-decode=2"], "0..1"),
    (["--rate", "kill-decode"], "NAME=NUMBER"),
    ([], "is not up"),
])
def test_the_command_refuses_bad_input_with_its_cause(args, says, tmp_path):
    env = {**os.environ, CACHE.name: str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "sglang_hardened", "sandbox", "soak", "--name", "nowhere", *args],
                         capture_output=True, text=True, env=env)
    assert run.returncode != 0 and says in run.stderr, run.stderr


def test_a_waiting_client_gives_up_when_told_and_not_before():
    """A real socket that never answers: the client stops waiting when ``give_up`` says so."""
    import socket
    import time

    from sglang_hardened.sandbox.soak.traffic import send

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        started = time.monotonic()
        sent = send(f"http://127.0.0.1:{server.getsockname()[1]}", _step("fits"), CAT, "r1", 30.0, None,
                    give_up=lambda sent_at: time.monotonic() - sent_at > 1.0)
    assert sent.status is None and "gave up" in sent.body and 1.0 <= time.monotonic() - started < 5.0


def _groups(tmp_path, prefills: int, decodes: int, ignore_term: bool = False) -> Cluster:
    """A cluster of real process groups standing in for servers (each one sleeps; it ignores
    SIGTERM if told), none listening."""
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)" if ignore_term \
        else "import time; time.sleep(120)"
    params = ClusterParams(base="0.5.23", instrument=True, prefills=prefills, decodes=decodes)
    cluster = Cluster(params, "t", tmp_path)
    for name in (*cluster.servers("prefill"), *cluster.servers("decode")):
        proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        cluster.procs[name] = Proc(name, proc.pid, "", f"http://127.0.0.1:9/{name}", 9, [sys.executable, "-c", code])
    cluster.instruments.prepare()
    return cluster


def test_a_server_fault_hits_one_server_of_its_role_and_an_abort_every_one(tmp_path):
    cluster = Cluster(ClusterParams(base="0.5.23", instrument=True, prefills=2, decodes=3), "t", tmp_path)
    cluster.instruments.prepare()
    injector = Injector(cluster, PLAN, lambda name: None, cluster.instruments)

    def hit(fault: str, target: int) -> list[str]:
        return injector.targets(replace(_step("fits", fault), target=target))

    assert [hit("kill-decode", t) for t in range(4)] == [["decode"], ["decode-1"], ["decode-2"], ["decode"]]
    assert hit("stop-prefill", 3) == ["prefill-1"] and hit("fail-part-way", 2) == ["prefill"]  # a prefill's writes
    assert hit("abort-decode", 1) == ["decode", "decode-1", "decode-2"]  # only the one serving it has the rid
    assert hit("rolling-restart", 0) == ["prefill", "prefill-1", "decode", "decode-1", "decode-2"]
    steps = [PLAN.step(c, i) for c in range(8) for i in range(200)]
    assert {s.target % 2 for s in steps if s.fault == "kill-prefill"} == {0, 1}  # the draw reaches both


@pytest.mark.parametrize("ignore_term", [False, True])
def test_a_rolling_restart_replaces_every_server_in_turn_each_gone_before_it_starts_again(tmp_path, monkeypatch,
                                                                                       ignore_term):
    """Prefills first, one at a time: SIGTERM to the first process, then (if it ignored it, after
    the grace) SIGKILL to its group, then the restart, which returns once the server is healthy."""
    monkeypatch.setattr("sglang_hardened.sandbox.soak.faults.TERM_GRACE_S", 1.0)
    cluster = _groups(tmp_path, 2, 2, ignore_term)
    old = {name: proc.pid for name, proc in cluster.procs.items()}
    order: list[str] = []

    def restart(name: str) -> None:
        assert not group_pids(old[name]), f"{name} restarted while its old processes lived"
        assert all(n in order or n == name for n in cluster.procs if list(old).index(n) < list(old).index(name))
        order.append(name)
        new = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        cluster.procs[name] = replace(cluster.procs[name], pid=new.pid)

    injector = Injector(cluster, replace(PLAN, release_timeout_s=0.1), restart, cluster.instruments)
    try:
        injector.fire(replace(_step("fits", "rolling-restart"), fault_after_s=0.0), "r1")
        injector.finish(60)
        assert order == ["prefill", "prefill-1", "decode", "decode-1"] and injector.error is None
        [event] = injector.events
        assert event.landed and event.targets == tuple(order) and "in turn" in event.note, event
        assert {str(pid) for pid in old.values()} <= set(injector.killed)  # their writes ended when they did
    finally:
        for proc in cluster.procs.values():
            signal_group(proc.pid, signal.SIGKILL)


def test_a_server_fault_waits_for_a_write_of_its_own_server(tmp_path):
    """A write by prefill 11 into decode 21's pages is in flight: it is prefill 11's and decode
    21's, not decode 22's."""
    ledger = _OpenWrites(tmp_path)
    (tmp_path / "21.jsonl").write_text(json.dumps({"t": 1.0, "ev": "expose", "room": 5, "pages": [3]}) + "\n")
    (tmp_path / "11.jsonl").write_text(json.dumps({"t": 2.0, "ev": "begin", "room": 5, "w": 1, "pages": [3]}) + "\n")
    assert ledger.any({}, {"11"}) and ledger.any({}, {"21"}) and not ledger.any({}, {"22"}) and ledger.any({})


def _ledger_of_a_freed_source(folder) -> None:
    """Prefill 11 frees source page 1 while its write into decode 21's page 3 is in flight."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "21.jsonl").write_text(json.dumps({"t": 1.0, "ev": "expose", "room": 5, "pages": [3]}) + "\n")
    (folder / "11.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (
        {"t": 2.0, "ev": "begin", "room": 5, "w": 1, "pages": [3], "src": [1]},
        {"t": 3.0, "ev": "srcfree", "pages": [1]},
        {"t": 4.0, "ev": "end", "room": 5, "w": 1})))


@pytest.mark.parametrize("killed, found", [({}, True), ({"22": 2.5}, True), ({"21": 2.5}, False)])
def test_a_source_freed_under_a_write_is_excused_only_by_the_kill_of_the_decode_it_writes_into(tmp_path, killed, found):
    """Nobody reads what a write into a killed decode sends; a kill of another decode excuses nothing."""
    cluster = Cluster(ClusterParams(base="0.5.23", instrument=True, prefills=1, decodes=2), "t", tmp_path,
                      {n: Proc(n, 0, "", "http://127.0.0.1:9", 9) for n in ("prefill", "decode", "decode-1")})
    cluster.instruments.prepare()
    _ledger_of_a_freed_source(cluster.instruments.ledger_dir)
    injector = Injector(cluster, PLAN, lambda name: None, cluster.instruments)
    injector.killed.update(killed)
    kinds = [kind for kind, _ in _end_checks(cluster, injector, {}, PLAN, began=0.0)]
    assert ("source-freed-under-write" in kinds) == found, kinds
