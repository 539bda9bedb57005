"""A real SGLang PD cluster on 127.0.0.1: one or more prefills and decodes (``servers.py``
names them) and a load balancer in front of all of them (sglang-router's mini-lb, smg, or this
distribution's ``sglang-hardened lb``).

Every child runs in its own process group and carries a marker variable, so
teardown kills it and anything it spawned by pid even when a test fails or
the caller was a separate ``sandbox up`` invocation. Start-up waits have
deadlines; any failure raises with the failing server's log tail.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.knobs import BOOTSTRAP_TOKEN, SANDBOX
from ..common.paths import cache_dir
from ..operations.deploy_wiring import SMG_KEYS_FLAG
from ..operations.oracle import Reply, generate
from .env import SandboxEnv, SandboxError, overlay_module
from .servers import ServerSpec, lb_server_args, role_of, server_names, server_specs

if TYPE_CHECKING:  # instruments read the checkout's overlay: only a cluster that asks for them needs it
    from .instruments import Instruments

BIND_FAILED = "address already in use"
AT_REST_WAIT_S = 30.0  # the ready probe's pages back (_wait_at_rest), else the start is tried again
WAIT_POLL_S = 0.25  # start-up readiness polls: /health is cheap, and every start waits on several
RESTART_DEADLINE_S = 180.0  # a restarted server must be healthy by then (it loads the model again)

# CUDA graphs off: 0.5.19 has only the disable flags; 0.5.20 on name backends.
_BACKENDS_DISABLED = ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
CUDA_GRAPHS_OFF = {
    "0.5.19": ["--disable-prefill-cuda-graph", "--disable-decode-cuda-graph"],
    **{base: _BACKENDS_DISABLED for base in ("0.5.20", "0.5.21", "0.5.22", "0.5.23")},
}
log = logging.getLogger("sglang_hardened.sandbox")
# the in-flight mode's delay (``ClusterParams.inflight_s``): several of the tiny model's CPU forwards,
# so every pass of the overlap loop's PD queues falls inside one unfinished batch
INFLIGHT_S = 0.2
# DP attention: every base turns the all-to-all LM head on for decode with pure DP attention, and
# its custom op has no CPU kernel; upstream's own opt-out, passed to both roles alike.
DP_LM_HEAD_ON_CPU = ["--no-enable-tp-lm-head-all-to-all"]
BACKENDS = {"mooncake": "mooncake_tcp", "nixl": "nixl"}
# The upstream routers, started in PD mode from the SGLang environment's pins.
PD_ROUTERS = {"mini-lb": ("sglang_router.launch_router", "--pd-disaggregation", "--mini-lb"),
              "smg": ("smg", "launch", "--pd-disaggregation")}
LBS = (*PD_ROUTERS, "hardened")  # and ours, `sglang-hardened lb`


@dataclass(frozen=True)
class ClusterParams:
    """What a test or user chooses about a cluster; ports 0 are picked free."""

    base: str
    backend: str = "mooncake"
    prefill_pool_tokens: int = 256
    decode_pool_tokens: int = 4096
    context_length: int = 1024
    decode_context_length: int | None = None  # decode's own, to give the roles unequal input limits
    page_size: int = 1
    chunked_prefill_size: int | None = None
    waiting_timeout_s: int = 300
    extra_flags: tuple[str, ...] = ()
    extra_env: tuple[str, ...] = ()  # NAME=VALUE for both servers, e.g. a hardening override
    probe_transfer: bool = True  # ready = a request served; False: the lb's /health (transfers expected to fail)
    prefill_port: int = 0
    decode_port: int = 0
    lb_port: int = 0
    lb: str = "mini-lb"  # or "hardened": `sglang-hardened lb` from the tool's own environment; or "smg"
    via_launch: bool = False  # servers start through `sglang-hardened launch` (H10's policy), as operators do
    instrument: bool = False  # the page ledger and fault hooks, switched by files in the run's folder
    tp: int = 1  # tensor-parallel ranks of prefill (and of decode unless decode_tp says otherwise)
    decode_tp: int | None = None  # decode's own TP size: a mismatched-TP deployment
    dp: int = 1  # data-parallel attention groups on both roles (--enable-dp-attention), inside the TP ranks
    prefills: int = 1  # prefill servers, each its own process, ports and transfer engine
    decodes: int = 1  # decode servers, likewise
    # each prefill's KV pool tokens, its context length at most that (empty: prefill_pool_tokens for every one)
    prefill_limits: tuple[int, ...] = ()
    # each prefill's context length (empty: as above): a lower input limit over a pool that still holds
    # the prompt it keeps, so an over-limit prompt it truncates is served (a pool no larger than the
    # context leaves no room for the truncated prompt's last page)
    prefill_contexts: tuple[int, ...] = ()
    # each forward's result reaches the scheduler this long after the forward returns (the overlay's
    # sgl_inflight: a GPU batch still running while the overlap loop goes on); 0: at once, as on CPU
    inflight_s: float = 0.0
    prefill_pp: int = 1  # prefill's pipeline-parallel stages (decode runs one), as PP prefill deployments do

    def count(self, role: str) -> int:
        """How many servers of ``role`` the cluster runs."""
        return self.prefills if role == "prefill" else self.decodes

    def specs(self) -> list[ServerSpec]:
        """Every server to start, prefills first."""
        return server_specs(self)

    def role_tp(self, role: str) -> int:
        return self.decode_tp if role == "decode" and self.decode_tp is not None else self.tp

    def role_ranks(self, role: str) -> int:
        """The processes ``role`` runs its model on: TP ranks times PP stages."""
        return self.role_tp(role) * (self.prefill_pp if role == "prefill" else 1)

    def validate(self) -> None:
        if self.base not in CUDA_GRAPHS_OFF:
            raise SandboxError(f"unknown base {self.base!r}: the cluster supports {', '.join(CUDA_GRAPHS_OFF)}")
        if any("=" not in kv for kv in self.extra_env):
            raise SandboxError(f"extra env entries must be NAME=VALUE: {self.extra_env}")
        if self.backend not in BACKENDS:
            raise SandboxError(f"unknown backend {self.backend!r}: choose {', '.join(BACKENDS)}")
        if self.lb not in LBS:
            raise SandboxError(f"unknown lb {self.lb!r}: choose {', '.join(LBS)}")
        if self.prefills < 1 or self.decodes < 1:
            raise SandboxError(f"a cluster needs at least one server per role, not {self.prefills} prefills "
                               f"and {self.decodes} decodes")
        if self.prefill_limits and (len(self.prefill_limits) != self.prefills or min(self.prefill_limits) < 1):
            raise SandboxError(f"prefill limits {list(self.prefill_limits)} must be one positive pool size per "
                               f"prefill ({self.prefills})")
        if self.prefill_contexts and (len(self.prefill_contexts) != self.prefills or min(self.prefill_contexts) < 1):
            raise SandboxError(f"prefill contexts {list(self.prefill_contexts)} must be one positive length per "
                               f"prefill ({self.prefills})")
        if self.inflight_s < 0:
            raise SandboxError(f"the in-flight delay must be 0 (off) or more, not {self.inflight_s}")
        if self.dp < 1:
            raise SandboxError(f"the DP size must be at least 1, not {self.dp}")
        if self.prefill_pp < 1:
            raise SandboxError(f"prefill's PP size must be at least 1, not {self.prefill_pp}")
        for role in ("prefill", "decode"):
            if self.role_tp(role) < 1 or self.role_tp(role) % self.dp:
                raise SandboxError(f"{role}'s TP size {self.role_tp(role)} must be a positive multiple of the "
                                   f"DP size {self.dp} (DP attention splits the TP ranks into DP groups)")


@dataclass
class Proc:
    """One child process: its pid (also its process group), log file, URL and port."""

    name: str
    pid: int
    log: str
    url: str
    port: int
    cmd: list[str] = field(default_factory=list)  # how it was started (a server: to restart it)


@dataclass
class Cluster:
    """A started cluster; ``stop()`` tears it all down."""

    params: ClusterParams
    run_id: str
    run_dir: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    bootstrap_ports: dict[str, int] = field(default_factory=dict)  # prefill name -> its bootstrap port
    startup_s: float = 0.0
    envs: dict[str, SandboxEnv] = field(default_factory=dict)  # each server's build, by name: what a restart runs
    # both roles' H14/H4 secret, as the recipe's Secret gives it (extra_env may override it)
    bootstrap_token: str = ""

    @property
    def instruments(self) -> Instruments | None:
        if not self.params.instrument:
            return None
        from .instruments import Instruments

        return Instruments(self.run_dir / "instruments")

    @property
    def bootstrap_port(self) -> int:
        """The first prefill's bootstrap port."""
        return self.bootstrap_ports["prefill"]

    def servers(self, role: str) -> list[str]:
        """That role's server names, in order."""
        return server_names(role, self.params.count(role))

    @property
    def lb_url(self) -> str:
        return self.procs["lb"].url

    @property
    def prefill_url(self) -> str:
        return self.procs["prefill"].url

    @property
    def decode_url(self) -> str:
        return self.procs["decode"].url

    def generate(self, text: str, max_new_tokens: int = 8, timeout: float = 600.0) -> Reply:
        return generate(self.lb_url, text, max_new_tokens, timeout)

    def used_tokens(self) -> dict[str, int]:
        """KV tokens each server holds now (``/v1/loads``), by name: the page accounting tests compare."""
        used = {}
        for name in (*self.servers("prefill"), *self.servers("decode")):
            with urllib.request.urlopen(f"{self.procs[name].url}/v1/loads", timeout=30) as reply:
                used[name] = sum(load["num_used_tokens"] for load in json.load(reply)["loads"])
        return used

    def add_lb(self, kind: str, env: SandboxEnv, deadline_s: float = 120.0) -> str:
        """Start another load balancer of ``kind`` in front of the same servers (once: a cluster
        shared by tests may be asked twice); return its URL."""
        name = f"lb-{kind}"
        if name in self.procs and _alive(self.procs[name].pid):
            return self.procs[name].url
        _start_lb(self, env, kind, name, _ports([0])[0])
        wait_ready(self, [name], time.monotonic() + deadline_s, serves)
        return self.procs[name].url

    def log_tail(self, name: str, lines: int = 40) -> str:
        try:
            text = Path(self.procs[name].log).read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def event_loops(self) -> dict[str, set[str]]:
        """The event loops each server's schedulers entered, as they logged it (the overlay's
        ``sgl_inflight``, wrapping what upstream's own dispatch calls), by server name."""
        said = f"{_inflight().LOOP}: "
        return {name: {line.split(said, 1)[1].split()[0] for line in self.log_tail(name, 10**6).splitlines()
                       if said in line} for name in (*self.servers("prefill"), *self.servers("decode"))}

    def log_tails(self, lines: int = 40) -> str:
        return "\n".join(f"--- {n} log tail ({p.log}) ---\n{self.log_tail(n, lines)}" for n, p in self.procs.items())

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "run_dir": str(self.run_dir), "params": asdict(self.params),
                "servers": {role: self.servers(role) for role in ("prefill", "decode")},
                "bootstrap_port": self.bootstrap_port, "bootstrap_ports": self.bootstrap_ports,
                "startup_s": round(self.startup_s, 1), "procs": {n: asdict(p) for n, p in self.procs.items()},
                "envs": {n: {"base": e.base, "python": str(e.python), "path": list(map(str, e.path))} for n, e in self.envs.items()},
                "urls": {n: p.url for n, p in self.procs.items()}, "bootstrap_token": self.bootstrap_token}

    @classmethod
    def from_json(cls, data: dict) -> Cluster:
        params = ClusterParams(**{**data["params"], **{k: tuple(data["params"].get(k, ()))
                                                       for k in ("extra_flags", "extra_env", "prefill_limits",
                                                                 "prefill_contexts")}})
        envs = {n: SandboxEnv(e["base"], Path(e["python"]), tuple(map(Path, e["path"]))) for n, e in data.get("envs", {}).items()}
        return cls(params, data["run_id"], Path(data["run_dir"]),
                   {n: Proc(**p) for n, p in data["procs"].items()},
                   data.get("bootstrap_ports", {"prefill": data["bootstrap_port"]}), data["startup_s"], envs,
                   data.get("bootstrap_token", ""))

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM each group, SIGKILL what is left, then any straggler with our marker."""
        for p in self.procs.values():
            signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and marked_pids(self.run_id):
            time.sleep(0.2)
        for p in self.procs.values():
            signal_group(p.pid, signal.SIGKILL)
        for pid in marked_pids(self.run_id):
            _signal(pid, signal.SIGKILL)
        for p in self.procs.values():
            reap(p.pid)
        # a killed server's sockets close asynchronously: teardown ends when its ports are free
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (marked_pids(self.run_id) or self.held_ports()):
            time.sleep(0.2)

    def restart(self, name: str, env: SandboxEnv | None = None, deadline_s: float = RESTART_DEADLINE_S) -> None:
        """Kill server ``name`` (if anything of it is left) and start it again on the same
        ports (from ``env``, by default the build it ran), as an orchestrator replaces a
        crashed pod; return once it is healthy."""
        env = env or self.envs[name]
        proc = self.procs[name]
        signal_group(proc.pid, signal.SIGKILL)
        reap(proc.pid)
        ports = [proc.port] + ([self.bootstrap_ports[name]] if name in self.bootstrap_ports else [])
        deadline = time.monotonic() + 30
        while any(port_in_use(p) for p in ports) and time.monotonic() < deadline:
            time.sleep(0.2)
        pid, log = spawn(name, proc.cmd, child_env(env, self.params, self.run_id, self.instruments, role_of(name),
                                                   self.bootstrap_token), self.run_dir, append=True)
        self.procs[name] = Proc(name, pid, log, proc.url, proc.port, proc.cmd)
        wait_ready(self, [name], time.monotonic() + deadline_s, healthy)

    def held_ports(self) -> list[int]:
        ports = [p.port for p in self.procs.values()] + list(self.bootstrap_ports.values())
        return [port for port in ports if port and port_in_use(port)]


def signal_group(pid: int, sig: int) -> None:
    if pid <= 0:  # os.killpg(0) would signal the caller's own group
        return
    try:
        os.killpg(pid, sig)  # each child leads its own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def marked_pids(run_id: str | None = None, within: str | None = None) -> list[int]:
    """Live pids whose environment carries the sandbox marker (for ``run_id``, or any) and, if
    given, the ``NAME=VALUE`` entry ``within`` (a test session's own, inherited by every child)."""
    needle = f"{SANDBOX.name}={run_id}".encode() if run_id else f"{SANDBOX.name}=".encode()
    also = within.encode() if within else None
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "stat").read_text().split(") ", 1)[1].startswith("Z"):
                continue
            environ = (d / "environ").read_bytes().split(b"\0")
            if any(v.startswith(needle) for v in environ) and (also is None or also in environ):
                found.append(int(d.name))
        except (OSError, IndexError):
            continue
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leftovers(ports: list[int], run_id: str | None = None, within: str | None = None) -> list[str]:
    """What the harness left behind: live marked processes (of ``run_id``, or any, or those
    carrying ``within``: a run beside this one keeps its own), and which of ``ports`` someone holds."""
    found = [f"process {pid}" for pid in marked_pids(run_id, within)]
    return found + [f"port {port}" for port in sorted(set(ports)) if port_in_use(port)]


def port_in_use(port: int) -> bool:
    """Someone listens on it (TIME_WAIT leftovers of closed connections do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _ports(wanted: list[int]) -> list[int]:
    """Free ports for the zeros; a clear error for a requested port already held."""
    for port in wanted:
        if port and port_in_use(port):
            raise SandboxError(f"port {port} on 127.0.0.1 is already in use")
    chosen: list[int] = []
    for port in wanted:
        while not port:
            port = free_port()
            port = 0 if port in chosen or port in wanted else port
        chosen.append(port)
    return chosen


def _server_cmd(env: SandboxEnv, p: ClusterParams, model: Path, spec: ServerSpec, port: int) -> list[str]:
    # `launch` is the hardened build's tool wheel, installed beside it; it execs SGLang's own launcher
    launcher = ["sglang_hardened", "launch", "--"] if p.via_launch else ["sglang.launch_server"]
    role = spec.role
    cmd = [str(env.python), "-m", *launcher, "--model-path", str(model),
           "--host", "127.0.0.1", "--port", str(port),
           "--context-length", str(spec.context_length), "--page-size", str(p.page_size),
           "--disaggregation-mode", role, "--disaggregation-transfer-backend", BACKENDS[p.backend],
           # without it the CPU pool is sized from host RAM and decode is killed for memory
           "--max-total-tokens", str(spec.pool_tokens),
           *cpu_flags(p, role)]
    if p.chunked_prefill_size:
        cmd += ["--chunked-prefill-size", str(p.chunked_prefill_size)]
    return cmd + parallel_flags(p, role) + list(p.extra_flags)


def parallel_flags(p: ClusterParams, role: str) -> list[str]:
    """TP, DP-attention and (prefill's) PP sizes; none for one rank, so a one-rank command is what it always was."""
    flags = ["--tp-size", str(p.role_tp(role))] if p.role_tp(role) > 1 else []
    if role == "prefill" and p.prefill_pp > 1:
        flags += ["--pp-size", str(p.prefill_pp)]
    return flags + (["--dp-size", str(p.dp), "--enable-dp-attention"] if p.dp > 1 else [])


def rank_cores(ranks: int) -> str:
    """SGLang's CPU rank-to-core binding (SGLANG_CPU_OMP_THREADS_BIND): without it more ranks than
    NUMA nodes refuse to start. Ranks share this box's cores round-robin, one core each (OMP
    threads are 1 here anyway): the roles' ranks overlap, as servers on one host do."""
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[rank % len(cores)]) for rank in range(ranks))


def cpu_flags(p: ClusterParams, role: str) -> list[str]:
    """What a server needs on a CPU box on top of a GPU deployment's flags: the stand-in for the GPU."""
    flags = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--dtype", "float32", *CUDA_GRAPHS_OFF[p.base],
             # an idle scheduler otherwise spins a whole core; it parks only while it has no batch, queue,
             # transfer or deferred release (upstream's is_fully_idle), waking on the next request
             "--sleep-on-idle"]
    if role == "decode":
        flags += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]  # host_pool registers CUDA host memory
    return flags + (DP_LM_HEAD_ON_CPU if p.dp > 1 else [])


def child_env(env: SandboxEnv, p: ClusterParams, run_id: str, instruments: Instruments | None = None,
              role: str | None = None, token: str = "") -> dict[str, str]:
    """A child's environment; ``role`` names a server's, whose ranks get their cores; ``token``
    is the cluster's bootstrap token (H14)."""
    e = env.environ()
    if role and p.role_ranks(role) > 1:
        e["SGLANG_CPU_OMP_THREADS_BIND"] = rank_cores(p.role_ranks(role))
    e.update({
        SANDBOX.name: run_id,
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_HOST_IP": "127.0.0.1",  # else SGLang advertises the external address
        "MC_FORCE_TCP": "1",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(p.waiting_timeout_s),
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(p.waiting_timeout_s),
        "HF_HUB_OFFLINE": "1",  # a missing model dir must fail, not try the hub
        "TRANSFORMERS_OFFLINE": "1",
        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": "0",  # no CUDA: a crash need not wait 60 s
        # nor sleep 5 s "to let GPU activity settle" before diagnostics a CPU box cannot take (every stop)
        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
        "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    if token:
        e[BOOTSTRAP_TOKEN.name] = token
    if p.inflight_s:
        e[_inflight().DELAY_ENV] = str(p.inflight_s)
    e.update(kv.split("=", 1) for kv in (*(instruments.env() if instruments else ()), *p.extra_env))
    return e


def spawn(name: str, cmd: list[str], env: dict[str, str], run_dir: Path, append: bool = False) -> tuple[int, str]:
    log = run_dir / f"{name}.log"
    with log.open("a" if append else "w") as out:
        # cwd: ``python -m`` puts it first on sys.path, so the caller's could shadow sglang
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, cwd=run_dir)
    return proc.pid, str(log)


def _alive(pid: int) -> bool:
    return _ended(pid) is None


def _ended(pid: int) -> str | None:
    """None while ``pid`` runs; else how it ended ("exit code 3", "killed by SIGKILL"), as far as
    this process can tell: only a child's code is ours to read (reading it reaps the child), so
    one we did not start (``sandbox status``) or reaped before just "exited"."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return f"exit code {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
    except ChildProcessError:
        pass  # not our child: fall back to /proc
    stat = Path(f"/proc/{pid}/stat")
    alive = stat.exists() and not stat.read_text().split(") ", 1)[1].startswith("Z")
    return None if alive else "exited"


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def lost_port_race(log_tail: str) -> bool:
    """Whether a process's log says it could not bind its port: uvicorn writes the errno's text
    in lower case, smg (a Rust process) as the OS words it, capitalised."""
    return BIND_FAILED in log_tail.lower()


class PortRace(SandboxError):
    """A port picked free was taken before the server bound it (SGLang and Mooncake pick
    their own internal ports at random, so the window cannot be closed from outside)."""


class NotAtRest(SandboxError):
    """The ready probe's pages were not back in time: a test would take a busy pool for the
    idle one (a loaded machine's slow release, or a leak the start itself shows)."""


def start(env: SandboxEnv, params: ClusterParams, model: Path, deadline_s: float = 300.0,
          prefill_env: SandboxEnv | None = None) -> Cluster:
    """Start every prefill and decode and the load balancer; return once a request through the
    lb succeeds.

    ``prefill_env`` runs the prefills from another build of the same base (a rolling upgrade's
    mixed cluster: an unhardened prefill in front of a hardened decode); decodes and the lb
    run from ``env``. On any failure everything started is killed and SandboxError carries
    the failing server's log tail. A lost race for a port picked here is retried once with
    fresh ports (a port the caller asked for is never swapped), and so is a start whose ready
    probe's pages do not come back (``NotAtRest``).
    """
    try:
        return _start_once(env, params, model, deadline_s, prefill_env)
    except PortRace:
        if params.prefill_port or params.decode_port or params.lb_port:
            raise
        return _start_once(env, params, model, deadline_s, prefill_env)
    except NotAtRest as e:
        log.warning("sandbox: started again: %s", str(e).splitlines()[0])
        return _start_once(env, params, model, deadline_s, prefill_env)


def _start_once(env: SandboxEnv, params: ClusterParams, model: Path, deadline_s: float,
                prefill_env: SandboxEnv | None) -> Cluster:
    params.validate()
    role_envs = {"prefill": prefill_env or env, "decode": env}
    if any(e.base != params.base for e in role_envs.values()):
        raise SandboxError(f"environments are for {role_envs['prefill'].base} (prefill) and {env.base} "
                           f"(decode), the cluster asks for {params.base}")
    t0 = time.monotonic()
    run_id = uuid.uuid4().hex[:12]
    run_dir = cache_dir() / "runs" / run_id
    run_dir.mkdir(parents=True)
    specs = params.specs()
    prefills = [s.name for s in specs if s.role == "prefill"]
    *server_ports, lp = _ports([s.port for s in specs] + [0] * len(prefills) + [params.lb_port])
    cluster = Cluster(params, run_id, run_dir, bootstrap_ports=dict(zip(prefills, server_ports[len(specs):])),
                      envs={s.name: role_envs[s.role] for s in specs}, bootstrap_token=secrets.token_hex(16))
    if cluster.instruments:
        cluster.instruments.prepare()
    try:
        for spec, port in zip(specs, server_ports):
            cmd = _server_cmd(cluster.envs[spec.name], params, model, spec, port)
            if spec.role == "prefill":
                cmd += ["--disaggregation-bootstrap-port", str(cluster.bootstrap_ports[spec.name])]
            pid, log = spawn(spec.name, cmd, child_env(cluster.envs[spec.name], params, run_id, cluster.instruments,
                                                       spec.role, cluster.bootstrap_token), run_dir)
            cluster.procs[spec.name] = Proc(spec.name, pid, log, f"http://127.0.0.1:{port}", port, cmd)
        # mini-lb reaches the servers only per request, so it loads (it imports sglang) beside them;
        # ours and smg check their health at start (smg asks again only 30 s later), so they start
        # once the servers are healthy
        lb_first = params.lb == "mini-lb"
        if lb_first:
            _start_lb(cluster, env, params.lb, "lb", lp)
        wait_ready(cluster, [s.name for s in specs], t0 + deadline_s, healthy)
        if not lb_first:
            _start_lb(cluster, env, params.lb, "lb", lp)
        wait_ready(cluster, ["lb"], t0 + deadline_s, serves if params.probe_transfer else healthy)
        if params.probe_transfer:
            _in_its_mode(cluster)
            _wait_at_rest(cluster, t0 + deadline_s)
    except BaseException:
        cluster.stop()
        raise
    cluster.startup_s = time.monotonic() - t0
    (run_dir / "cluster.json").write_text(json.dumps(cluster.to_json(), indent=1))
    return cluster


def _start_lb(cluster: Cluster, env: SandboxEnv, kind: str, name: str, port: int) -> None:
    """Start load balancer ``kind`` in front of every prefill and decode of the cluster.

    mini-lb (sglang-router) and the SGLang Model Gateway (smg) run from the packages pinned
    with the SGLang environment, ours from the tool's own (this interpreter), each as an
    operator's router runs: without the SGLang wheel on its path (mini-lb imports SGLang only for
    tracing, which is off: 5 CPU-seconds a start). smg's metrics listener would take 0.0.0.0:29000
    in every cluster: it gets a free port on 127.0.0.1. smg gets an admin key of its own, as the
    recipe's from its Secret: without one, anyone who reaches its port changes its worker pool;
    whoever needs it reads it from the Proc's argv, as an operator from the Secret."""
    servers = lb_server_args(kind, [(cluster.procs[n].url, cluster.bootstrap_ports[n]) for n in cluster.servers("prefill")],
                             [cluster.procs[n].url for n in cluster.servers("decode")])
    if kind in PD_ROUTERS:
        cmd = [str(env.python), "-m", *PD_ROUTERS[kind], *servers]
        if kind == "smg":
            cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                    SMG_KEYS_FLAG, f"sandbox:operator:admin:{secrets.token_hex(16)}"]
        lb_env = child_env(env, cluster.params, cluster.run_id)
        lb_env.pop("PYTHONPATH")
    else:
        cmd = [sys.executable, "-m", "sglang_hardened", "lb", *servers]
        lb_env = {**os.environ, SANDBOX.name: cluster.run_id}
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    pid, log = spawn(name, cmd, lb_env, cluster.run_dir)
    cluster.procs[name] = Proc(name, pid, log, f"http://127.0.0.1:{port}", port, cmd)


def serves(url: str) -> bool:
    """The lb is ready when a real request through it succeeds (its /health says less)."""
    try:
        return generate(url, "ready", max_new_tokens=1, timeout=60).status == 200
    except OSError:
        return False


def _wait_at_rest(cluster: Cluster, deadline: float) -> None:
    """Until the ready probe's pages are back on both roles (what tests take as the idle count):
    prefill gives them back a scheduler pass or more after the answer (with DP attention up to
    about 3 s on CPU; a hardened NIXL prefill's source hold ends only once its drain watcher
    settles, which a loaded 2-core CI machine once saw after the count was taken). A cluster
    that keeps them past the bound fails its start (``start`` tries once more), so no test
    takes a busy pool as its idle baseline."""
    start = time.monotonic()
    bound = min(deadline, start + AT_REST_WAIT_S)
    while used := {role: n for role, n in cluster.used_tokens().items() if n}:
        if time.monotonic() >= bound:
            raise NotAtRest(f"KV tokens still held {time.monotonic() - start:.0f} s after the ready probe: {used}\n"
                            f"{cluster.log_tails()}")
        time.sleep(WAIT_POLL_S)


def _inflight():
    return overlay_module("sgl_inflight")


def _in_its_mode(cluster: Cluster) -> None:
    """Fail the start unless every server logged the event loop it runs and, in the in-flight
    mode, that its loop went on past an unfinished batch (after a request long enough to run
    decode's forwards): instrumentation that did not apply must not pass for a mode that ran."""
    missing = [name for name, loops in cluster.event_loops().items() if not loops]
    if cluster.params.inflight_s:
        cluster.generate("ready in flight", max_new_tokens=4)
        logs = {name: cluster.log_tail(name, 10**6) for name in (*cluster.servers("prefill"), *cluster.servers("decode"))}
        missing += [f"{name} ({_inflight().ON!r})" for name, text in logs.items() if _inflight().ON not in text]
        missing += [f"every {role} ({_inflight().WAITED!r})" for role in ("prefill", "decode")  # the probe met one of each
                    if not any(_inflight().WAITED in text for name, text in logs.items() if role_of(name) == role)]
    if missing:
        raise SandboxError(f"the overlay's sgl_inflight did not report from {', '.join(missing)}\n{cluster.log_tails()}")


def wait_ready(cluster: Cluster, names: list[str], deadline: float, ready: Callable[[str], bool]) -> None:
    """Until every server of ``names`` is ``ready``. Any process of the cluster that exits meanwhile
    fails the wait, named with its exit code and log: a restart must not read as the restarted
    server's failure when another one died."""
    pending = list(names)
    while pending:
        for proc in cluster.procs.values():  # every server so far, not only those awaited
            # a lost port race first: uvicorn may linger after it, or exit at once
            if lost_port_race(cluster.log_tail(proc.name, 20)):
                raise PortRace(f"{proc.name} could not bind its port\n{cluster.log_tails()}")
        ended = {proc.name: (how, proc.log) for proc in cluster.procs.values() if (how := _ended(proc.pid))}
        if ended:
            meanwhile = f"while {', '.join(names)} started"
            raise SandboxError("; ".join(
                f"{name} exited {'during start-up' if name in names else meanwhile} ({how}; its log: {log})"
                for name, (how, log) in ended.items()) + f"\n{cluster.log_tails()}")
        for name in list(pending):
            if ready(cluster.procs[name].url):
                pending.remove(name)
        if pending and time.monotonic() > deadline:
            raise SandboxError(f"{', '.join(pending)} not ready before the deadline\n{cluster.log_tails()}")
        if pending:
            time.sleep(WAIT_POLL_S)
