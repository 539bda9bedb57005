"""Run a rendered Kubernetes recipe's pods on 127.0.0.1, as the kubelet starts them.

The recipe's end-to-end test proves that deploy/kubernetes/'s own commands start, serve, gate
and roll a PD deployment of several servers per role. Each workload's pods are started as its
rendered replicas say, each container's command and arguments expanded as the kubelet expands
them (`$(VAR)` from the container's environment: the params ConfigMap through envFrom, then its
env). Each pod gets an address of its own in 127.0.0.0/8, so every server listens on the ports
the manifests name, as in a pod network. What a cluster, a GPU and an RDMA NIC give is stood in
for, and only that: the Kubernetes API server by `kube_api.KubeAPI` (the pods smg's service
discovery lists and watches), a pod's IP by its loopback address (`localize`: `0.0.0.0` and
`127.0.0.1` inside a pod are that address, a Service's name one of the pods it selects), the
servers get the sandbox's CPU flags, Mooncake runs over TCP, `sglang-hardened` is the sandbox
build's (as the image installs it), and each Secret the pods read holds a random value
(`stand_in_secret`).
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..common.paths import cache_dir
from ..operations import deploy_wiring
from ..operations.deploy_shape import gateway_deployment, servers
from ..operations.deploy_wiring import pod_templates
from ..operations.drain import held
from ..operations.gateway_pool import KEY_ENV, pool
from .cluster import (
    BACKENDS,
    Cluster,
    ClusterParams,
    Proc,
    _alive,
    _ended,
    child_env,
    cpu_flags,
    healthy,
    reap,
    serves,
    signal_group,
    spawn,
    wait_ready,
)
from .env import SandboxEnv, SandboxError
from .kube_api import KubeAPI
from .servers import server_names

RECIPE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
NAMESPACE = "sglang-hardened"  # the namespace the pods run in, as the API stand-in serves it
_REFERENCE = re.compile(r"\$\$|\$\((\w+)\)")
_SECRET_SALT = secrets.token_hex(16)


@dataclass(frozen=True)
class Container:
    """One container as the kubelet would start it: expanded argv and environment."""

    component: str
    name: str
    argv: list[str]
    env: dict[str, str]
    probe: list[str]  # its readiness exec command, expanded; empty if it has none
    pre_stop: list[str]  # its preStop exec command, expanded; empty if it has none
    grace_s: int  # the pod's terminationGracePeriodSeconds


def render(overlay: str, params_text: str | None = None) -> list[dict]:
    """`kubectl kustomize` of an overlay of deploy/kubernetes, with another params.env if given."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "kubernetes"
        shutil.copytree(RECIPE, tree)
        if params_text is not None:
            (tree / "params" / "params.env").write_text(params_text)
        return deploy_wiring.render(tree / overlay)


def stand_in_secret(name: str, key: str) -> str:
    """What the operator's Secret would hold for `name`/`key`: random for this process, the same
    for every container that reads it (both roles share the bootstrap token)."""
    return hashlib.sha256(f"{_SECRET_SALT}/{name}/{key}".encode()).hexdigest()[:32]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined variable's value, `$$` a literal `$`, else as written."""
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _REFERENCE.sub(one, text)


def _environment(container: dict, config_maps: dict[str, dict], fields: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif (path := var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")) in fields:
            env[var["name"]] = fields[path]
        elif ref := var.get("valueFrom", {}).get("secretKeyRef"):
            env[var["name"]] = stand_in_secret(ref["name"], ref["key"])
        else:
            raise SandboxError(f"{container['name']}: env {var['name']} comes from {var.get('valueFrom')}, "
                               "which the sandbox cannot stand in for")
    return env


def containers(docs: list[dict], pod_ip: str = "127.0.0.1") -> dict[str, Container]:
    """Every container of the recipe by `component/name`, expanded as the kubelet would in a pod at `pod_ip`."""
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    fields = {"status.podIP": pod_ip, "metadata.namespace": NAMESPACE}
    out = {}
    for component, template in pod_templates(docs).items():
        for c in template["spec"]["containers"]:
            env = _environment(c, config_maps, fields)
            hooks = {k: c.get(k, {}).get("exec", {}).get("command", []) for k in ("readinessProbe",)}
            hooks["preStop"] = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
            out[f"{component}/{c['name']}"] = Container(
                component, c["name"], [expand(a, env) for a in c.get("command", []) + c.get("args", [])], env,
                [expand(a, env) for a in hooks["readinessProbe"]], [expand(a, env) for a in hooks["preStop"]],
                template["spec"].get("terminationGracePeriodSeconds", 30))
    return out


@dataclass
class Pod:
    """One running pod of the recipe: its loopback address, and its process in the cluster."""

    name: str
    component: str
    ip: str
    proc: str  # its name in Cluster.procs ("prefill", "prefill-1", ...; the gateway is "lb")
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict


@dataclass
class Recipe:
    """A recipe running on 127.0.0.0/8: its servers and gateways (as `lb`, `lb-1`, ...) in
    `cluster`, its pods, and the API stand-in smg discovers them through."""

    cluster: Cluster
    docs: list[dict]
    api: KubeAPI
    env: SandboxEnv
    path: str  # PATH for the recipe's commands: the shims first
    pods: dict[str, Pod] = field(default_factory=dict)
    failed_hooks: list[str] = field(default_factory=list)  # preStop hooks that failed, as the kubelet's events
    _subnet: str = field(default_factory=lambda: f"127.{random.randrange(64, 250)}.{random.randrange(256)}.")
    _last_ip: int = 1

    def localize(self, argv: list[str], pod_ip: str) -> list[str]:
        """The only change to a rendered command: a pod's own addresses are its loopback one, and
        a Service's name is the address of a Ready pod it selects."""
        out: list[str] = []
        for arg in argv:
            previous = out[-1] if out else ""
            if previous in ("--host", "--prometheus-host") and arg == "0.0.0.0":
                arg = pod_ip
            arg = arg.replace("http://127.0.0.1:", f"http://{pod_ip}:")
            for service in (d for d in self.docs if d["kind"] == "Service"):
                name = service["metadata"]["name"]
                if f"http://{name}:" in arg:
                    arg = arg.replace(f"http://{name}:", f"http://{self._selected(service['spec']['selector']).ip}:")
            out.append(arg)
        return out

    def _selected(self, selector: dict[str, str]) -> Pod:
        found = [p for p in self.pods.values() if all(p.labels.get(k) == v for k, v in selector.items())]
        if not found:
            raise SandboxError(f"no running pod is selected by {selector}")
        return found[0]

    def container(self, key: str, pod_ip: str, docs: list[dict] | None = None) -> Container:
        return containers(docs or self.docs, pod_ip)[key]

    def server_pods(self, role: str) -> list[Pod]:
        return sorted((p for p in self.pods.values() if p.component == role), key=lambda p: p.proc)

    def gateways(self) -> list[Pod]:
        """The gateway pods running, in the order they were first started (`lb` first)."""
        return self.server_pods("gateway")

    def url(self, pod: Pod) -> str:
        return self.cluster.procs[pod.proc].url

    def start_server(self, role: str, proc: str, docs: list[dict] | None = None) -> Pod:
        """Schedule a new pod of `role` (from these docs, by default the running recipe's), with an
        address of its own, and start its server; the caller waits for it and admits it."""
        template = pod_templates(docs or self.docs)[role]
        self._last_ip += 1
        name = f"{proc}-{uuid.uuid4().hex[:5]}"
        pod = Pod(name, role, f"{self._subnet}{self._last_ip}", proc, template["metadata"].get("labels", {}),
                  template["metadata"].get("annotations", {}), template["spec"])
        server = self.container(f"{role}/server", pod.ip, docs)
        argv = self.localize(server.argv, pod.ip) + cpu_flags(self.cluster.params, role)
        environ = {**child_env(self.env, self.cluster.params, self.cluster.run_id, role=role), **server.env}
        _start(self, proc, argv, environ, f"http://{pod.ip}:{_http_port(template)}")
        self.pods[name] = pod
        self.api.put(name, pod.labels, pod.annotations, pod.spec, pod.ip, ready=False)
        return pod

    def admit(self, pod: Pod) -> None:
        """Its readiness probe passed: the kubelet reports the pod Ready (smg adds it to its pool)."""
        self.api.put(pod.name, pod.labels, pod.annotations, pod.spec, pod.ip, ready=True)

    def delete(self, pod: Pod) -> float:
        """`kubectl delete pod`, as the kubelet carries it out: the pod is marked (smg drops it),
        its preStop hook runs, then SIGTERM and, past the grace period, SIGKILL. Returns the
        seconds the hook took."""
        server = self.container(f"{pod.component}/server", pod.ip)
        self.api.mark_deleted(pod.name)
        t0 = time.monotonic()
        hook = subprocess.run(self.localize(server.pre_stop, pod.ip), env={**os.environ, **server.env, "PATH": self.path},
                              capture_output=True, text=True, timeout=server.grace_s, check=False) if server.pre_stop else None
        hook_s = time.monotonic() - t0
        if hook is not None and hook.returncode:  # the kubelet records FailedPreStopHook and goes on
            self.failed_hooks.append(f"{pod.name}: {hook.stdout}{hook.stderr}")
        proc = self.cluster.procs[pod.proc]
        signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + max(0.0, server.grace_s - hook_s)
        while _alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        signal_group(proc.pid, signal.SIGKILL)
        reap(proc.pid)
        self.api.stopped(pod.name)
        self.api.remove(pod.name)
        del self.pods[pod.name]
        return hook_s

    def replace(self, pod: Pod, docs: list[dict] | None = None, deadline_s: float = 300.0) -> Pod:
        """One step of a rolling update: delete `pod`, then its successor is scheduled, becomes
        Ready and joins smg's pool."""
        self.delete(pod)
        new = self.start_server(pod.component, pod.proc, docs)
        wait_ready(self.cluster, [new.proc], time.monotonic() + deadline_s, healthy)
        self.admit(new)
        return new

    def pool(self, gateway: Pod | None = None) -> dict[str, list[str]]:
        """The pool of `gateway`'s smg (by default the first gateway's), as the gate reads it
        (GET /workers with the admin key)."""
        url = self.url(gateway) if gateway else self.cluster.lb_url
        return pool(url, timeout=10, key=self.container("gateway/gateway", "").env[KEY_ENV])

    def wait_pool(self, deadline_s: float = 120.0) -> None:
        """Until every gateway's pool is exactly the Ready server pods (smg reconciles on every
        watch event; each gateway watches on its own)."""
        want = {role: sorted(self.url(p) for p in self.server_pods(role)) for role in ("prefill", "decode")}
        deadline = time.monotonic() + deadline_s
        for gateway in self.gateways():
            found: dict = {}
            while time.monotonic() < deadline:
                try:
                    found = self.pool(gateway)
                except Exception:  # noqa: BLE001 - an empty role refuses: smg is still adding
                    found = {}
                if found == want:
                    break
                time.sleep(0.5)
            else:
                raise SandboxError(f"{gateway.name}'s smg pool is {found}, not the Ready pods {want}\n"
                                   f"{self.cluster.log_tail(gateway.proc, 60)}")

    def held(self) -> dict[str, int]:
        """Requests and KV tokens each server holds now (zero on all: nothing leaked)."""
        return {p.proc: held(self.url(p)) for role in ("prefill", "decode") for p in self.server_pods(role)}

    def run(self, container: Container, argv: list[str], timeout_s: float,
            pod: Pod | None = None) -> subprocess.CompletedProcess:
        """A one-shot command of `container` (the gate's probe in a gateway pod, the canary), as it
        runs in `pod` (by default the first of its component)."""
        pods = [pod] if pod else [p for p in self.pods.values() if p.component == container.component]
        local = self.localize(argv, pods[0].ip if pods else "127.0.0.1")
        return subprocess.run(local, env={**os.environ, **container.env, "PATH": self.path},
                              capture_output=True, text=True, timeout=timeout_s, check=False)

    def start_gateway(self, proc: str, deadline_s: float = 300.0) -> Pod:
        """Schedule a gateway pod as `proc` (`lb`, `lb-1`, ...) and start its smg, as the pod runs
        it: its Kubernetes client pointed at the API stand-in, with the ServiceAccount token the
        pod would have mounted; return once a request through it is answered."""
        template = pod_templates(self.docs)["gateway"]
        self._last_ip += 1
        pod = Pod(f"gateway-{uuid.uuid4().hex[:5]}", "gateway", f"{self._subnet}{self._last_ip}", proc,
                  template["metadata"]["labels"], {}, template["spec"])
        smg = self.container("gateway/gateway", pod.ip)
        environ = {**child_env(self.env, self.cluster.params, self.cluster.run_id), **smg.env,
                   "KUBECONFIG": str(self.api.kubeconfig(self.cluster.run_dir / "kubeconfig"))}
        environ.pop("PYTHONPATH")  # as the sandbox runs every router: without SGLang on its path
        self.pods[pod.name] = pod
        _start(self, proc, self.localize(smg.argv, pod.ip), environ, f"http://{pod.ip}:{_http_port(template)}")
        wait_ready(self.cluster, [proc], time.monotonic() + deadline_s, serves)
        return pod

    def lose(self, pod: Pod) -> str:
        """The pod's node is lost: its processes are killed at once (no preStop hook, no grace),
        and it is gone (its process too, so no later wait takes its exit for a failure). Returns
        how its process ended."""
        proc = self.cluster.procs.pop(pod.proc)
        signal_group(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (how := _ended(proc.pid)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        del self.pods[pod.name]
        return how or "still running"

    def stop(self) -> None:
        self.cluster.stop()
        self.api.stop()


def _http_port(template: dict) -> int:
    return next(p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
                if p["name"] == "http")


def _shims(run_dir: Path, env: SandboxEnv) -> str:
    """`sglang-hardened` as the image's console script runs it, for the sandbox build; smg from its pins."""
    bin_dir = run_dir / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "sglang-hardened"
    shim.write_text(f"#!/bin/sh\nexec {env.python} -m sglang_hardened \"$@\"\n")
    shim.chmod(0o755)
    return os.pathsep.join([str(bin_dir), str(env.python.parent), os.environ.get("PATH", "")])


def _gateway_rules(docs: list[dict]) -> list[dict]:
    """The rules of the Roles bound to the gateway pod's ServiceAccount: what the API stand-in allows."""
    account = pod_templates(docs)["gateway"]["spec"].get("serviceAccountName")
    bound = {b["roleRef"]["name"] for b in docs if b["kind"] == "RoleBinding"
             and {"kind": "ServiceAccount", "name": account} in b.get("subjects", [])}
    return [r for d in docs if d["kind"] == "Role" and d["metadata"]["name"] in bound for r in d["rules"]]


def start(env: SandboxEnv, docs: list[dict], deadline_s: float = 600.0) -> Recipe:
    """Start every server pod the recipe's workloads ask for and its gateways (the Deployment's
    replicas, each its own smg); return once each gateway's pool holds each server and a request
    through each is answered.

    Its params name the sandbox's model and a transfer backend a CPU box runs (mooncake_tcp);
    on failure everything started is stopped and SandboxError carries the logs' tails.
    """
    values = containers(docs)["prefill/server"].env
    backend = {v: k for k, v in BACKENDS.items()}[values["TRANSFER_BACKEND"]]
    replicas = {role: sum(w.replicas for w in servers(docs) if w.component == role) for role in ("prefill", "decode")}
    params = ClusterParams(env.base, backend=backend, prefills=replicas["prefill"], decodes=replicas["decode"],
                           prefill_pool_tokens=int(values["PREFILL_MAX_TOTAL_TOKENS"]),
                           decode_pool_tokens=int(values["DECODE_MAX_TOTAL_TOKENS"]),
                           context_length=int(values["CONTEXT_LENGTH"]), page_size=int(values["PAGE_SIZE"]),
                           lb="smg")
    run_id = uuid.uuid4().hex[:12]
    run_dir = cache_dir() / "runs" / run_id
    run_dir.mkdir(parents=True)
    recipe = Recipe(Cluster(params, run_id, run_dir, envs={"prefill": env, "decode": env}), docs,
                    KubeAPI(NAMESPACE, _gateway_rules(docs)), env, _shims(run_dir, env))
    t0 = time.monotonic()
    try:
        for role in ("prefill", "decode"):
            for name in recipe.cluster.servers(role):
                recipe.start_server(role, name)
        wait_ready(recipe.cluster, list(recipe.cluster.procs), t0 + deadline_s, healthy)
        for pod in list(recipe.pods.values()):
            recipe.admit(pod)
        for proc in server_names("lb", gateway_deployment(docs)[0]["spec"].get("replicas", 1)):
            recipe.start_gateway(proc, max(1.0, t0 + deadline_s - time.monotonic()))
        recipe.wait_pool(max(1.0, t0 + deadline_s - time.monotonic()))
    except BaseException:
        recipe.stop()
        raise
    recipe.cluster.startup_s = time.monotonic() - t0
    return recipe


def _start(recipe: Recipe, name: str, argv: list[str], env: dict[str, str], url: str) -> None:
    """Spawn one of the cluster's processes (a server, or a gateway as `lb`, `lb-1`, ...); its log
    goes on after its predecessor's under the same name (the run's folder is its own)."""
    pid, log = spawn(name, argv, {**env, "PATH": recipe.path}, recipe.cluster.run_dir, append=True)
    recipe.cluster.procs[name] = Proc(name, pid, log, url, int(url.rsplit(":", 1)[1]), argv)
