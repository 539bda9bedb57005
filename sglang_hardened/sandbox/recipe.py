"""Run a rendered Kubernetes recipe's containers on 127.0.0.1, as the kubelet starts them.

The recipe's end-to-end test proves that deploy/kubernetes/'s own commands start, serve and
gate a PD deployment. Each container's command and arguments are expanded as the kubelet
expands them (`$(VAR)` from the container's environment: the params ConfigMap through
envFrom, then its env; the pod IP is 127.0.0.1). What a pod network, a GPU and an RDMA NIC
give is stood in for, and only that (`localize`): each Service becomes 127.0.0.1 with a free
port per server, `--host 0.0.0.0` becomes 127.0.0.1, the servers get the sandbox's CPU flags,
Mooncake runs over TCP, `sglang-hardened` is the sandbox build's (as the image installs it), and
each Secret the pods read holds a random value (`stand_in_secret`).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..common.paths import cache_dir
from ..operations import deploy_wiring
from ..operations.deploy_wiring import pod_templates
from .cluster import (
    BACKENDS,
    Cluster,
    ClusterParams,
    Proc,
    child_env,
    cpu_flags,
    free_port,
    healthy,
    reap,
    serves,
    signal_group,
    spawn,
    wait_ready,
)
from .env import SandboxEnv, SandboxError

RECIPE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
SERVICE_OF = {"prefill": "sglang-hardened-prefill", "decode": "sglang-hardened-decode", "gateway": "sglang-hardened-gateway"}
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


def _environment(container: dict, config_maps: dict[str, dict]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = "127.0.0.1"
        elif ref := var.get("valueFrom", {}).get("secretKeyRef"):
            env[var["name"]] = stand_in_secret(ref["name"], ref["key"])
        else:
            raise SandboxError(f"{container['name']}: env {var['name']} comes from {var.get('valueFrom')}, "
                               "which the sandbox cannot stand in for")
    return env


def containers(docs: list[dict]) -> dict[str, Container]:
    """Every container of the recipe by `component/name`, expanded as the kubelet would."""
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    out = {}
    for component, template in pod_templates(docs).items():
        for c in template["spec"]["containers"]:
            env = _environment(c, config_maps)
            probe = c.get("readinessProbe", {}).get("exec", {}).get("command", [])
            out[f"{component}/{c['name']}"] = Container(
                component, c["name"], [expand(a, env) for a in c.get("command", []) + c.get("args", [])], env,
                [expand(a, env) for a in probe])
    return out


def service_ports(docs: list[dict]) -> dict[str, dict[str, int]]:
    """Each Service's ports by name (http, bootstrap)."""
    return {d["metadata"]["name"]: {p["name"]: p["port"] for p in d["spec"]["ports"]}
            for d in docs if d["kind"] == "Service"}


@dataclass
class Recipe:
    """A recipe running on 127.0.0.1: its cluster (servers and gateway as `lb`) and the rest."""

    cluster: Cluster
    containers: dict[str, Container]
    ports: dict[str, dict[str, int]]  # Service ports as rendered
    local: dict[tuple[str, int], int]  # (Service, port) -> the port on 127.0.0.1 standing in for it
    path: str  # PATH for the recipe's commands: the shims first

    def localize(self, argv: list[str], component: str) -> list[str]:
        """The only change to a rendered command: Service addresses and ports become local ones."""
        out: list[str] = []
        for arg in argv:
            previous = out[-1] if out else ""
            for service, ports in self.ports.items():
                for port in ports.values():
                    arg = arg.replace(f"http://{service}:{port}", f"http://127.0.0.1:{self.local[(service, port)]}")
            if previous in ("--host", "--prometheus-host") and arg == "0.0.0.0":
                arg = "127.0.0.1"
            elif previous == "--prometheus-port":  # a port of the pod's own, in no Service
                arg = str(self.local.setdefault((component, int(arg)), free_port()))
            elif previous == "--port":
                service = SERVICE_OF[component]
                arg = str(self.local[(service, int(arg))])
            elif previous == "--disaggregation-bootstrap-port" or (previous == self.url("prefill") and arg.isdigit()):
                # the second form is smg's `--prefill URL BOOTSTRAP_PORT`
                arg = str(self.local[(SERVICE_OF["prefill"], int(arg))])
            out.append(arg)
        return out

    def start_server(self, server: Container) -> None:
        """Start (or, as a rollout replaces its pod, start again) one role's server container;
        the caller waits for it to be healthy, or to exit."""
        role, cluster = server.component, self.cluster
        if role in cluster.procs:
            signal_group(cluster.procs[role].pid, signal.SIGKILL)
            reap(cluster.procs[role].pid)
        argv = self.localize(server.argv, role) + cpu_flags(cluster.params, role)
        _start(self, role, argv, {**child_env(cluster.envs[role], cluster.params, cluster.run_id, role=role), **server.env})

    def url(self, component: str) -> str:
        """Where the stand-in for a component's Service serves HTTP."""
        service = SERVICE_OF[component]
        return f"http://127.0.0.1:{self.local[(service, self.ports[service]['http'])]}"

    def run(self, container: Container, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        """A one-shot command of `container` (the preflight gate's probe, the canary), as it runs there."""
        return subprocess.run(self.localize(argv, container.component),
                              env={**os.environ, **container.env, "PATH": self.path},
                              capture_output=True, text=True, timeout=timeout_s, check=False)


def _shims(run_dir: Path, env: SandboxEnv) -> str:
    """`sglang-hardened` as the image's console script runs it, for the sandbox build; smg from its pins."""
    bin_dir = run_dir / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "sglang-hardened"
    shim.write_text(f"#!/bin/sh\nexec {env.python} -m sglang_hardened \"$@\"\n")
    shim.chmod(0o755)
    return os.pathsep.join([str(bin_dir), str(env.python.parent), os.environ.get("PATH", "")])


def start(env: SandboxEnv, docs: list[dict], deadline_s: float = 300.0) -> Recipe:
    """Start the recipe's prefill and decode servers and its gateway; return once all are healthy.

    Its params name the sandbox's model and a transfer backend a CPU box runs (mooncake_tcp);
    on failure everything started is stopped and SandboxError carries the logs' tails.
    """
    found = containers(docs)
    servers = {role: found[f"{role}/server"] for role in ("prefill", "decode")}
    values = servers["prefill"].env
    backend = {v: k for k, v in BACKENDS.items()}[values["TRANSFER_BACKEND"]]
    params = ClusterParams(env.base, backend=backend, prefill_pool_tokens=int(values["PREFILL_MAX_TOTAL_TOKENS"]),
                           decode_pool_tokens=int(values["DECODE_MAX_TOTAL_TOKENS"]),
                           context_length=int(values["CONTEXT_LENGTH"]), page_size=int(values["PAGE_SIZE"]),
                           lb="smg")
    run_id = uuid.uuid4().hex[:12]
    run_dir = cache_dir() / "runs" / run_id
    run_dir.mkdir(parents=True)
    ports = service_ports(docs)
    local = {(service, port): free_port() for service, named in ports.items() for port in named.values()}
    recipe = Recipe(Cluster(params, run_id, run_dir, envs={"prefill": env, "decode": env}), found, ports, local,
                    _shims(run_dir, env))
    cluster = recipe.cluster
    cluster.bootstrap_ports = {"prefill": local[(SERVICE_OF["prefill"], ports[SERVICE_OF["prefill"]]["bootstrap"])]}
    t0 = time.monotonic()
    try:
        for server in servers.values():
            recipe.start_server(server)
        wait_ready(cluster, ["prefill", "decode"], t0 + deadline_s, healthy)
        gateway = found["gateway/gateway"]
        gateway_env = {**child_env(env, params, run_id), **gateway.env}
        gateway_env.pop("PYTHONPATH")  # as the sandbox runs every router: without SGLang on its path
        _start(recipe, "lb", recipe.localize(gateway.argv, "gateway"), gateway_env)
        wait_ready(cluster, ["lb"], t0 + deadline_s, serves)  # smg's /health is up before its workers are
    except BaseException:
        cluster.stop()
        raise
    cluster.startup_s = time.monotonic() - t0
    return recipe


def _start(recipe: Recipe, name: str, argv: list[str], env: dict[str, str]) -> None:
    """Spawn one of the cluster's processes (prefill, decode, or the gateway as `lb`)."""
    url = recipe.url("gateway" if name == "lb" else name)
    pid, log = spawn(name, argv, {**env, "PATH": recipe.path}, recipe.cluster.run_dir)
    recipe.cluster.procs[name] = Proc(name, pid, log, url, int(url.rsplit(":", 1)[1]), argv)
