"""The Kubernetes recipe's own commands run two prefills and two decodes behind two smg gateways,
each of which finds them itself; the gate judges each gateway's pool, server by server; losing a
gateway loses only what it held, and a rolling restart through smg loses and leaks nothing.

deploy/kubernetes/lws is rendered with CPU-sized parameters and each pod its workloads ask for
(two per role and two gateways, as shipped) is started as the kubelet would start it
(sandbox/recipe.py), each at an address of its own in 127.0.0.0/8 on the ports the manifests
name. Stand-ins, and only these:
the Kubernetes API server is a stand-in for the control plane (sandbox/kube_api.py: the pod
list and watch smg's service discovery calls, held to the recipe's Role; no kube-apiserver ships
as a Debian or PyPI package), a pod's IP is its loopback address, the servers get the sandbox's
CPU flags, the params name the sandbox's model and Mooncake over TCP (no RDMA NIC here), and
each Secret the pods read holds a random value.
Tier: full. Cost: one cluster start (four servers and smg: 139 s), one canary run, and six
server starts after it (747 s): four for the rolling restart (each waits out its drain), one
refused by H7, one with another page size; 1011 s in all (2 cores shared with other sessions,
2026-12-06, `scripts/test tests/e2e/test_kubernetes_recipe.py`, the environment already built).
The second gateway and its loss add about 25 s and no cluster start or server restart: a second
smg at the start, a gateway's successor (6 s); 952 s in all at load 20-30 (2026-12-06, the same command).
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

from sglang_hardened.cli import main
from sglang_hardened.operations.oracle import generate
from sglang_hardened.sandbox import recipe
from sglang_hardened.sandbox.cluster import healthy
from sglang_hardened.sandbox.model import ensure_model
from tests.harness import CLUSTER_START, SERVER_RESTART, eventually, phase

from .conftest import sandbox_env
from .test_smg_control_plane import REFUSED, admin_key, call

pytestmark = pytest.mark.e2e

BASE = "0.5.23"
# A CPU-sized deployment: the pools hold the context on both roles, as deploy check wants.
CPU_PARAMS = {"CONTEXT_LENGTH": "1024", "PREFILL_MAX_TOTAL_TOKENS": "2048", "DECODE_MAX_TOTAL_TOKENS": "4096",
              "PAGE_SIZE": "16", "TRANSFER_BACKEND": "mooncake_tcp"}
H7_REFUSAL = "sglang-hardened H7: this prefill server's KV pool holds"


def params_text(**values: str) -> str:
    text = recipe.RECIPE.joinpath("params", "params.env").read_text()
    for key, value in values.items():
        text, count = re.subn(rf"^{key}=.*$", f"{key}={value}", text, flags=re.M)
        assert count == 1, key
    return text


@pytest.fixture(scope="module")
def deployment():
    env = sandbox_env(BASE, hardened=True)
    model = str(ensure_model(env, "tiny"))
    with phase(f"{CLUSTER_START} {BASE} recipe 2x2"):
        running = recipe.start(env, recipe.render("lws", params_text(MODEL_PATH=model, **CPU_PARAMS)))
    yield running, model
    running.stop()


@pytest.fixture
def clusters(request, deployment):
    request.node.sandbox_clusters = [deployment[0].cluster]  # the harness's log tails on a failure
    return deployment


def test_smg_finds_every_server_and_the_gate_judges_each(clusters):
    running, _ = clusters
    servers = {role: [running.url(p) for p in running.server_pods(role)] for role in ("prefill", "decode")}
    assert {role: len(urls) for role, urls in servers.items()} == {"prefill": 2, "decode": 2}
    assert running.pool() == {role: sorted(urls) for role, urls in servers.items()}  # found by smg, not given
    # smg asked the API only what the recipe's Role allows: list and watch pods in its namespace
    assert running.api.refused == [], running.api.refused
    assert {a.split()[0] for a in running.api.asked} == {"list", "watch"}
    assert all(f"/namespaces/{recipe.NAMESPACE}/pods" in a for a in running.api.asked)

    assert running.cluster.generate("the recipe serves").status == 200  # through smg, as a client would
    assert call(running.cluster.lb_url, "GET", "/workers")[0] in REFUSED  # the pool's routes take the key only
    assert call(running.cluster.lb_url, "GET", "/workers", admin_key(running.cluster, "lb"))[0] == 200

    gate = running.container("gateway/preflight-gate", "")
    passed = running.run(gate, gate.probe, timeout_s=120)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "preflight: ok" in passed.stdout
    assert all(url in passed.stdout for urls in servers.values() for url in urls), passed.stdout  # each judged

    canary = running.container("canary/canary", "")
    probed = running.run(canary, canary.argv, timeout_s=900)
    assert probed.returncode == 0, probed.stdout[-3000:] + probed.stderr[-3000:]
    report = json.loads(probed.stdout)  # --json alone: stdout is the report, the table went to stderr
    assert report["ok"] and any(c["result"] == "ok" for c in report["checks"]), report


def test_each_gateway_finds_and_gates_every_server_and_losing_one_loses_only_what_it_held(clusters):
    """The recipe's two gateway replicas, each its own smg: each finds the four servers through
    the API itself, serves, and its gate judges its whole pool. One gateway's node is lost while
    requests come through both: every attempt that fails was sent to it, each such request is
    answered once its client sends it to the other, whose own clients lose none; no server holds a
    request or a KV page afterwards, and the lost gateway's successor finds every server again."""
    running, _ = clusters
    servers = {role: sorted(running.url(p) for p in running.server_pods(role)) for role in ("prefill", "decode")}
    gateways = running.gateways()
    assert len(gateways) == 2  # base/gateway.yaml's replicas
    gate = running.container("gateway/preflight-gate", "")
    for gateway in gateways:
        assert running.pool(gateway) == servers, gateway.name
        judged = running.run(gate, gate.probe, timeout_s=120, pod=gateway)
        assert judged.returncode == 0 and "preflight: ok" in judged.stdout, judged.stdout + judged.stderr
        assert all(url in judged.stdout for urls in servers.values() for url in urls), judged.stdout

    kept, lost = gateways
    kept_url, lost_url = running.url(kept), running.url(lost)
    load = Load([kept_url, lost_url])
    try:
        assert eventually(lambda: load.answered(lost_url, 0) >= 4, timeout_s=300, interval_s=0.2)
        killed_at = time.monotonic()
        ended = running.lose(lost)
        assert eventually(lambda: load.answered(kept_url, killed_at) >= 8, timeout_s=300, interval_s=0.2)
    finally:
        load.stop()
    failed = [a for a in load.attempts if a.status != 200]
    print(f"\n{lost.name} {ended}: {len(failed)} of {len(load.attempts)} attempts failed, "
          f"{sum(a.sent < killed_at for a in failed)} of them held when it died")
    assert failed and all(a.url == lost_url and a.at >= killed_at for a in failed), failed[:5]
    assert any(a.sent < killed_at for a in failed), "the lost gateway held no request when it died"
    answered = {a.request for a in load.attempts if a.status == 200}
    assert {a.request for a in load.attempts} == answered, "a request was answered by neither gateway"
    deadline = time.monotonic() + 60
    while any(running.held().values()) and time.monotonic() < deadline:
        time.sleep(1)
    assert not any(running.held().values()), running.held()  # no request, no KV page left behind

    with phase(f"gateway start {lost.proc} {BASE} recipe, its node lost"):  # smg: seconds, not a server's restart
        successor = running.start_gateway(lost.proc)
        running.wait_pool()
    assert successor.ip != lost.ip and running.pool(successor) == servers


@dataclass(frozen=True)
class Attempt:
    """One request sent to one gateway: when, and what came back (status 0: no answer, or one
    without output)."""

    request: str
    url: str
    sent: float
    at: float
    status: int
    text: str


class Load:
    """Requests through the gateways at `urls`, one after another on each of two threads per
    gateway, until stopped: each attempt recorded (bounded: at most `limit` requests in all). A
    request that fails at its gateway is sent once more to the next one, as a client of the
    gateway Service reconnects to another endpoint (one gateway: not sent again)."""

    def __init__(self, urls: list[str], limit: int = 2000) -> None:
        self.urls, self.limit, self.attempts, self.stopped = urls, limit, [], threading.Event()
        self.requests = 0
        self.threads = [threading.Thread(target=self._send, args=(n,), daemon=True) for n in range(2 * len(urls))]
        for thread in self.threads:
            thread.start()

    def _send(self, n: int) -> None:
        first = n % len(self.urls)
        tries = [self.urls[first], *self.urls[first + 1:], *self.urls[:first]][:2]
        i = 0
        while not self.stopped.is_set() and self.requests < self.limit:
            self.requests += 1
            for url in tries:
                attempt = self._try(f"{n}-{i}", url)
                self.attempts.append(attempt)
                if attempt.status == 200:
                    break
            i += 1

    @staticmethod
    def _try(request: str, url: str) -> Attempt:
        sent = time.monotonic()
        try:
            reply = generate(url, f"rolling request {request}: count to three", max_new_tokens=8, timeout=120)
            return Attempt(request, url, sent, time.monotonic(), reply.status if reply.output_ids else 0, reply.body)
        except Exception as exc:  # noqa: BLE001 - every failure is a lost attempt, recorded as one
            return Attempt(request, url, sent, time.monotonic(), 0, repr(exc))

    def answered(self, url: str, since: float) -> int:
        """Attempts `url` answered after `since`."""
        return sum(a.url == url and a.status == 200 and a.sent > since for a in self.attempts)

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(timeout=180)


def test_a_rolling_restart_through_smg_loses_and_leaks_no_request(clusters):
    """Each server pod in turn is deleted as a rollout deletes it (marked: smg drops it; its
    preStop drain waits for what it holds; SIGTERM) and its successor joins smg's pool once
    Ready, while requests keep coming: every one is answered, during every step, and no server
    holds a request or a KV page afterwards."""
    running, _ = clusters
    load = Load([running.cluster.lb_url])
    steps = []
    try:
        for role in ("prefill", "decode"):
            for pod in running.server_pods(role):
                t0 = time.monotonic()
                with phase(f"{SERVER_RESTART} {pod.proc} {BASE} recipe rolling"):
                    new = running.replace(pod)
                    running.wait_pool()
                steps.append((pod.proc, t0, time.monotonic()))
                assert new.ip != pod.ip and running.url(new) in running.pool()[role]
        time.sleep(2)
    finally:
        load.stop()
    failed = [(a.status, a.text[:300]) for a in load.attempts if a.status != 200 or not a.text]
    assert not failed, f"{len(failed)} of {len(load.attempts)} requests failed during the rollout: {failed[:5]}"
    for proc, t0, t1 in steps:  # served through every step, not only between them
        assert sum(t0 <= a.at <= t1 for a in load.attempts) >= 2, (proc, steps, len(load.attempts))
    deadline = time.monotonic() + 60
    while any(running.held().values()) and time.monotonic() < deadline:
        time.sleep(1)
    assert not any(running.held().values()), running.held()  # no request, no KV page left behind
    assert running.failed_hooks == [], running.failed_hooks  # every drain ran to its end, none gave up
    assert running.api.refused == []


def test_deploy_check_and_h7_refuse_an_unsafe_pool_and_the_gate_catches_a_server_unlike_the_rest(clusters, tmp_path):
    """prefill's pool under the context: deploy check refuses the file before anything is applied;
    applied anyway, H7 refuses to start that pod, which never becomes Ready, and smg never routes to
    it. A prefill with another page size starts and joins smg's pool: the gate, judging each server
    smg routes to, fails on it (a Service would have shown it one prefill of two at random)."""
    running, model = clusters
    unsafe_text = params_text(MODEL_PATH=model, **{**CPU_PARAMS, "PREFILL_MAX_TOTAL_TOKENS": "512"})
    shutil.copytree(recipe.RECIPE, tmp_path / "kubernetes")  # the operator's copy of the recipe
    (tmp_path / "kubernetes" / "params" / "params.env").write_text(unsafe_text)
    checked = CliRunner().invoke(main, ["deploy", "check", str(tmp_path / "kubernetes" / "params" / "params.env")])
    assert checked.exit_code == 1 and "fewer than the context length 1024" in " ".join(checked.output.split())

    [first, second] = running.server_pods("prefill")
    running.delete(second)
    with phase(f"{SERVER_RESTART} {second.proc} {BASE} recipe unsafe pool"):
        refused = running.start_server("prefill", second.proc, recipe.render("lws", unsafe_text))
        deadline = time.monotonic() + 180
        while H7_REFUSAL not in running.cluster.log_tail(refused.proc, 80) and time.monotonic() < deadline:
            assert not healthy(running.url(refused)), "prefill started with a pool under its context"
            time.sleep(1)
    assert "fewer than its context length 1024" in running.cluster.log_tail(refused.proc, 80)
    assert running.pool()["prefill"] == [running.url(first)]  # never Ready: never routed to
    gate = running.container("gateway/preflight-gate", "")
    assert running.run(gate, gate.probe, timeout_s=120).returncode == 0  # what is routed to is safe

    running.delete(refused)
    with phase(f"{SERVER_RESTART} {second.proc} {BASE} recipe other page size"):
        other = running.start_server("prefill", second.proc, recipe.render("lws", params_text(
            MODEL_PATH=model, **{**CPU_PARAMS, "PAGE_SIZE": "32"})))
        deadline = time.monotonic() + 300
        while not healthy(running.url(other)) and time.monotonic() < deadline:
            time.sleep(1)
        running.admit(other)
        running.wait_pool()
    failed = running.run(gate, gate.probe, timeout_s=120)
    assert failed.returncode == 1, failed.stdout
    assert "preflight: UNSAFE" in failed.stdout and running.url(other) in failed.stdout
    assert "page_size" in failed.stdout or "page size" in failed.stdout, failed.stdout
