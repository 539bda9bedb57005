"""``sandbox up|down|status|soak``: the test cluster by hand, one named sandbox at a time."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..common.errors import HardenedError
from ..common.output import json_option, say, write_json
from ..common.paths import cache_dir
from ..runtime.release_timeout import release_timeout_s
from .cluster import BACKENDS, INFLIGHT_S, LBS, Cluster, ClusterParams, marked_pids, start
from .env import DEFAULT_PYTHON, PYTHONS, SandboxError, build_env, default_overlay, wheels_for
from .model import VARIANTS, default_variant, ensure_model
from .soak.plan import DEFAULT_MIX, DEFAULT_RATES, FAULTS, SoakPlan


def _fmt(shares: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in shares.items())


def _state(name: str) -> Path:
    return cache_dir() / "sandbox" / f"{name}.json"


def _save(name: str, cluster: Cluster) -> None:
    _state(name).parent.mkdir(parents=True, exist_ok=True)
    _state(name).write_text(json.dumps(cluster.to_json(), indent=1))


def _load(name: str) -> Cluster | None:
    path = _state(name)
    return Cluster.from_json(json.loads(path.read_text())) if path.is_file() else None


@click.group("sandbox")
def sandbox() -> None:
    """Run real SGLang prefills/decodes + a load balancer (mini-lb, ours or smg) on CPU, on 127.0.0.1."""


@sandbox.command()
@click.option("--name", default="default", show_default=True, help="Sandbox name (one cluster per name).")
@click.option("--base", required=True, help="SGLang release, e.g. 0.5.19.")
@click.option("--upstream/--hardened", "upstream", default=True, help="Pinned upstream wheel or hardened build.")
@click.option("--wheel", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Run this SGLang wheel instead (built for --python).")
@click.option("--python", "python", type=click.Choice(list(PYTHONS)), default=DEFAULT_PYTHON, show_default=True,
              help="The servers' Python: upstream's wheel for it, or its hardened build (production's image runs 3.12).")
@click.option("--backend", type=click.Choice(sorted(BACKENDS)), default="mooncake", show_default=True)
@click.option("--lb", type=click.Choice(LBS), default="mini-lb", show_default=True,
              help="sglang-router's mini-lb, `sglang-hardened lb`, or the SGLang Model Gateway (smg).")
@click.option("--prefill-pool-tokens", type=int, default=256, show_default=True)
@click.option("--decode-pool-tokens", type=int, default=4096, show_default=True)
@click.option("--context-length", type=int, default=1024, show_default=True)
@click.option("--decode-context-length", type=int, default=None, help="Decode's own (default: --context-length).")
@click.option("--page-size", type=int, default=1, show_default=True)
@click.option("--chunked-prefill-size", type=int, default=None)
@click.option("--waiting-timeout", type=int, default=300, show_default=True, help="Decode's PD waiting timeout, s.")
@click.option("--extra-flag", "extra_flags", multiple=True, help="Passed to both servers (repeatable).")
@click.option("--env", "extra_env", multiple=True, help="NAME=VALUE set for both servers (repeatable).")
@click.option("--via-launch", is_flag=True,
              help="Start the servers through `sglang-hardened launch` (the policy applied; --hardened only).")
@click.option("--overlay", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="CPU stand-ins dir (default: the checkout's tests/cpu_overlay).")
@click.option("--instrument", is_flag=True,
              help="Start with the page ledger and the fault hooks on (what `sandbox soak` needs).")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel ranks per role (gloo on CPU).")
@click.option("--decode-tp", type=int, default=None, help="Decode's own TP size (default: --tp): mismatched TP.")
@click.option("--dp", type=int, default=1, show_default=True, help="DP-attention groups per role, inside its TP ranks "
              "(the model is then qwen3 unless --model says otherwise).")
@click.option("--inflight", is_flag=True,
              help=f"A batch in flight: each forward's result reaches the scheduler {INFLIGHT_S:g} s after the forward "
                   "returns, as a GPU's does once its batch has run, so the overlap loop's PD queues run beside "
                   "an unfinished batch (tests/cpu_overlay/site/sgl_inflight.py).")
@click.option("--prefill-pp", type=int, default=1, show_default=True,
              help="Prefill's pipeline-parallel stages (gloo on CPU; decode runs one).")
@click.option("--model", "model", type=click.Choice(sorted(VARIANTS)), default=None,
              help="Tiny model variant [default: tiny; qwen3 with --dp: upstream's Llama cannot run DP attention].")
@click.option("--prefills", type=int, default=1, show_default=True,
              help="Prefill servers, each its own process, ports and transfer engine.")
@click.option("--decodes", type=int, default=1, show_default=True, help="Decode servers, likewise.")
@click.option("--prefill-limit", "prefill_limits", type=int, multiple=True,
              help="Each prefill's KV pool tokens, its context length at most that, in order (repeat once per "
                   "prefill; default: --prefill-pool-tokens and --context-length).")
@click.option("--prefill-context", "prefill_contexts", type=int, multiple=True,
              help="Each prefill's context length, in order, whatever its pool (repeat once per prefill): a "
                   "lower input limit on one prefill, as --allow-auto-truncate then truncates to.")
def up(name: str, base: str, upstream: bool, wheel: Path | None, python: str, backend: str, lb: str, prefill_pool_tokens: int,
       decode_pool_tokens: int, context_length: int, decode_context_length: int | None, page_size: int, chunked_prefill_size: int | None,
       waiting_timeout: int, extra_flags: tuple[str, ...], extra_env: tuple[str, ...], via_launch: bool,
       overlay: Path | None, instrument: bool, tp: int, decode_tp: int | None, dp: int, inflight: bool,
       model: str | None, prefills: int, decodes: int, prefill_limits: tuple[int, ...],
       prefill_contexts: tuple[int, ...], prefill_pp: int) -> None:
    """Build the environment if needed and start a cluster.

    \b
    Example:
      sglang-hardened sandbox up --base 0.5.23 --hardened --lb smg --prefill-pool-tokens 2048
      sglang-hardened sandbox up --base 0.5.23 --hardened --python 3.12 --via-launch --lb hardened
      sglang-hardened sandbox up --base 0.5.23 --hardened --instrument --prefill-pool-tokens 1024 \
        --decode-pool-tokens 2600 --env SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT=8
      sglang-hardened sandbox up --base 0.5.23 --hardened --tp 2 --decode-tp 1
      sglang-hardened sandbox up --base 0.5.23 --hardened --tp 2 --dp 2 --prefill-pool-tokens 2048
      sglang-hardened sandbox up --base 0.5.23 --hardened --prefills 2 --decodes 2 --lb smg
      sglang-hardened sandbox up --base 0.5.23 --hardened --prefills 2 --prefill-limit 600 --prefill-limit 1024
      sglang-hardened sandbox up --base 0.5.23 --prefills 2 --prefill-pool-tokens 1024 --prefill-context 1024 \
        --prefill-context 512 --extra-flag=--allow-auto-truncate
      sglang-hardened sandbox up --base 0.5.23 --model deepseek --page-size 64 --inflight --instrument
      sglang-hardened sandbox up --base 0.5.23 --model deepseek --page-size 64 --prefill-pp 2
    """
    try:
        old = _load(name)
        if old and marked_pids(old.run_id):
            raise SandboxError(f"sandbox {name!r} is running: `sandbox down --name {name}` first")
        params = ClusterParams(base=base, backend=backend, prefill_pool_tokens=prefill_pool_tokens,
                               decode_pool_tokens=decode_pool_tokens, context_length=context_length,
                               decode_context_length=decode_context_length,
                               page_size=page_size, chunked_prefill_size=chunked_prefill_size,
                               waiting_timeout_s=waiting_timeout, extra_flags=extra_flags, extra_env=extra_env,
                               lb=lb, via_launch=via_launch, instrument=instrument, tp=tp, decode_tp=decode_tp, dp=dp,
                               prefills=prefills, decodes=decodes, prefill_limits=prefill_limits,
                               prefill_contexts=prefill_contexts,
                               inflight_s=INFLIGHT_S if inflight else 0.0, prefill_pp=prefill_pp)
        params.validate()
        if via_launch and (upstream or wheel):
            raise SandboxError("--via-launch needs --hardened: `launch` comes with the hardened build's tool wheel")
        wheels = [wheel] if wheel else wheels_for(base, hardened=not upstream, python=python)
        env = build_env(base, wheels, overlay or default_overlay(), python)
        cluster = start(env, params, ensure_model(env, model or default_variant(dp)))
    except SandboxError as e:
        raise click.ClickException(str(e)) from e
    _save(name, cluster)
    loops = "; ".join(f"{role} {', '.join(sorted(names))}" for role, names in cluster.event_loops().items())
    click.echo(f"up in {cluster.startup_s:.0f}s on Python {python}: load balancer {cluster.lb_url} (event loops: {loops})")


@sandbox.command()
@click.option("--name", default="default", show_default=True)
def down(name: str) -> None:
    """Kill every process of the sandbox (by pid) and forget it.

    \b
    Example:
      sglang-hardened sandbox down --name default
    """
    cluster = _load(name)
    if cluster is None:
        click.echo(f"sandbox {name!r} is not up")
        return
    cluster.stop()
    _state(name).unlink()
    click.echo(f"sandbox {name!r} down")


@sandbox.command()
@click.option("--name", default="default", show_default=True)
@json_option("URLs and parameters")
def status(name: str, json_to: str | None) -> None:
    """Say whether the sandbox runs, with every server's URL and the parameters.

    \b
    Example:
      sglang-hardened sandbox status --json
      sglang-hardened sandbox status --name soak --json status.json
    """
    cluster = _load(name)
    info = cluster.to_json() if cluster else {}
    info["running"] = bool(cluster and marked_pids(cluster.run_id))
    if not cluster:
        say(f"sandbox {name!r} is not up", json_to)
    else:
        say(f"sandbox {name!r} {'running' if info['running'] else 'dead'}: "
            + ", ".join(f"{n} {u}" for n, u in info["urls"].items()), json_to)
    write_json(json_to, info)


def _pairs(values: tuple[str, ...], what: str) -> dict[str, float]:
    try:
        return {name: float(value) for name, value in (v.split("=", 1) for v in values)}
    except ValueError:
        raise click.BadParameter(f"{what} entries are NAME=NUMBER, got {', '.join(values)}") from None


@sandbox.command()
@click.option("--name", default="default", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Draws every request and fault.")
@click.option("--clients", type=int, default=8, show_default=True, help="Concurrent clients.")
@click.option("--duration", type=float, default=300.0, show_default=True, help="Seconds of traffic.")
@click.option("--rate", "rates", multiple=True, metavar="FAULT=SHARE",
              help=f"Share of requests carrying a fault, 0..1 (repeatable; default {_fmt(DEFAULT_RATES)}). "
                   f"Faults: {', '.join(FAULTS)}.")
@click.option("--mix", "mix", multiple=True, metavar="KIND=WEIGHT",
              help=f"Weight of a request kind (repeatable; default {_fmt(DEFAULT_MIX)}).")
@click.option("--release-timeout", type=float, default=None,
              help="Decode's deferred-release timeout, s (default: the sandbox's environment, else upstream's).")
@json_option("The report")
def soak(name: str, seed: int, clients: int, duration: float, rates: tuple[str, ...], mix: tuple[str, ...],
         release_timeout: float | None, json_to: str | None) -> None:
    """Sustained mixed traffic and random faults on an instrumented sandbox, each request judged
    against the quiet cluster and every page by the ledger. Exits 1 on any violation.

    \b
    Example:
      sglang-hardened sandbox soak --seed 7 --duration 120 --rate kill-decode=0 --json
      sglang-hardened sandbox soak --seed 7 --duration 120 --json soak.json
      sglang-hardened sandbox soak --seed 4242 --duration 300 --rate rolling-restart=0.002   # on --prefills 2 --decodes 2
      sglang-hardened sandbox up --base 0.5.23 --hardened --instrument --inflight && sglang-hardened sandbox soak

    A sandbox started with --inflight soaks in that mode (each forward's result released late).
    """
    from .soak.faults import RestartFailed  # they read the checkout's overlay: a soak runs from one
    from .soak.run import run_soak

    cluster = _load(name)
    environ = dict(kv.split("=", 1) for kv in (cluster.params.extra_env if cluster else ()))
    plan = SoakPlan(release_timeout or release_timeout_s(environ), seed, clients, duration,
                    {**DEFAULT_RATES, **_pairs(rates, "--rate")}, {**DEFAULT_MIX, **_pairs(mix, "--mix")},
                    waiting_timeout_s=cluster.params.waiting_timeout_s if cluster else 0.0)
    try:
        plan.validate()
        if cluster is None or not marked_pids(cluster.run_id):
            raise SandboxError(f"sandbox {name!r} is not up: `sandbox up --name {name} --instrument ...` first")
        try:
            report = run_soak(cluster, plan, progress=lambda line: click.echo(line, err=True))
        finally:
            _save(name, cluster)  # a restarted server has a new pid
    except RestartFailed as e:
        cluster.stop()
        _state(name).unlink()
        raise click.ClickException(f"{e}\nsandbox {name!r} stopped: nothing of it is left running") from e
    except (SandboxError, HardenedError) as e:
        raise click.ClickException(str(e)) from e
    if cluster.params.inflight_s:
        say(f"in flight: each forward's result released {cluster.params.inflight_s:g} s after it returned", json_to)
    say(report.table(), json_to)
    write_json(json_to, report.to_json())
    if not report.ok:
        raise SystemExit(1)
