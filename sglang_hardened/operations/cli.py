"""Operating a deployment: launch, policy, info, preflight, canary, deploy (parsing and printing only)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ..common.errors import HardenedError
from ..common.http_url import http_url
from ..common.output import OK, PROBLEM, UNJUDGED, json_option, say, write_json
from ..common.table import format_table


def _echo_findings(findings: list, json_to: str | None = None) -> None:
    """Preflight's findings (and deploy check's, the same rules) as one table, if any."""
    if findings:
        say("\n" + format_table(("severity", "where", "finding", "remedy"),
                                 [(f.severity, f.where, f.what, f.remedy) for f in findings]), json_to)


@click.command("preflight")
@click.option("--prefill", multiple=True, metavar="URL", help="A prefill node's HTTP URL (repeatable).")
@click.option("--decode", multiple=True, metavar="URL", help="A decode node's HTTP URL (repeatable).")
@click.option("--gateway", metavar="URL", help="Judge every prefill and decode in this SGLang Model Gateway's "
              "pool (its GET /workers, with the admin key from $GATEWAY_ADMIN_KEY), beside any --prefill/--decode.")
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds per query.")
@json_option("The report")
@click.option("--bootstrap/--no-bootstrap", default=True, show_default=True,
              help="Also read each hardened prefill's registered input limit from its bootstrap port (shown, not "
                   "judged); --no-bootstrap where a network policy keeps this host off that port.")
def preflight(prefill: tuple[str, ...], decode: tuple[str, ...], gateway: str | None, timeout: float,
              json_to: str | None, bootstrap: bool) -> None:
    """Check every live node of a PD deployment; exit 1 on any unsafe finding, 3 when the only
    ones are nodes that did not answer (nothing judged there).

    Reports each node's hardened version and hardening ids, KV pool vs
    context length, input limits, page size and KV layout, checksum flags,
    deferred KV release and transfer backend; then each finding with its
    remedy. Upstream nodes are reported as unhardened.

    \b
    Example:
      sglang-hardened preflight --prefill http://10.0.0.1:30000 --decode http://10.0.0.2:30000
      sglang-hardened preflight --prefill http://prefill:30000 --decode http://decode:30000 --no-bootstrap
      GATEWAY_ADMIN_KEY=... sglang-hardened preflight --gateway http://127.0.0.1:8000
    """
    from .gateway_pool import pool
    from .preflight import NODE_COLUMNS, node_row
    from .preflight import preflight as run_preflight

    found = pool(gateway, timeout) if gateway else {"prefill": [], "decode": []}
    prefills, decodes = [*prefill, *found["prefill"]], [*decode, *found["decode"]]
    if not prefills or not decodes:
        raise click.UsageError("name at least one --prefill and one --decode, or a --gateway")
    report = run_preflight(prefills, decodes, timeout, bootstrap)
    say(format_table(NODE_COLUMNS, [node_row(n) for n in report.nodes]), json_to)
    _echo_findings(report.findings, json_to)
    write_json(json_to, report.to_json())
    say(f"\npreflight: {'ok' if report.ok else 'UNSAFE'}", json_to)
    sys.exit(OK if report.ok else UNJUDGED if report.unjudged_only else PROBLEM)


@click.command("canary")
@click.option("--url", required=True, callback=http_url, help="The deployment's load balancer.")
@click.option("--tokenize-url", callback=http_url, help="An SGLang server of the deployment (a prefill) whose /tokenize cuts every "
                                     "prompt to its exact length [default: --url; a gateway may not serve it].")
@click.option("--pool-tokens", type=int, required=True, help="Prefill KV pool size in tokens (preflight shows it).")
@click.option("--context-length", type=int, required=True, help="The nodes' context length (preflight shows it).")
@click.option("--tenants", type=int, default=2, show_default=True)
@click.option("--repeats", type=int, default=4, show_default=True,
              help="Requests per tenant before each probe; enough to cycle decode's free pages "
                   "(decode pool tokens / 0.7 x the smaller of pool and context, plus 1).")
@click.option("--rounds", type=int, default=2, show_default=True)
@click.option("--max-requests", type=int, default=80, show_default=True)
@click.option("--time-budget", type=float, default=600.0, show_default=True, help="Seconds for the whole probe.")
@json_option("The report")
def canary(url: str, tokenize_url: str | None, pool_tokens: int, context_length: int, tenants: int, repeats: int, rounds: int,
           max_requests: int, time_budget: float, json_to: str | None) -> None:
    """Probe a deployment through its LB for cross-tenant leaks; exit 1 on failure, 3 when the
    deployment did not answer (nothing judged).

    Fails if an answer holds another tenant's canary string, if a prompt
    over the prefill KV pool gets a 2xx, or if a greedy probe's output
    changes with the tenant that ran before it. A check this deployment's
    answers could not fail (a model that never repeats its own canary,
    probes that were all refused) shows n/a and does not count.

    Every prompt is cut to its exact length by an SGLang server's /tokenize;
    a server that does not count them leaves the probe unjudged (exit 3).

    \b
    Example:
      sglang-hardened canary --url http://10.0.0.9:8000 --tokenize-url http://10.0.0.1:30000 \\
        --pool-tokens 65536 --context-length 32768 --json canary.json
    """
    from .canary import Plan, run_canary

    plan = Plan(pool_tokens, context_length, tenants, repeats, rounds, max_requests=max_requests,
                time_budget_s=time_budget)
    report = run_canary(url, plan, progress=lambda line: click.echo(line, err=True), tokenize_url=tokenize_url)
    say(format_table(("check", "result", "detail"), [(c.name, c.result, c.detail[:100]) for c in report.checks]),
        json_to)
    say(f"\ncanary: {'ok' if report.ok else 'FAILED'} ({report.requests} requests, {report.seconds:.0f} s)", json_to)
    write_json(json_to, report.to_json())
    sys.exit(OK if report.ok else UNJUDGED if report.unjudged else PROBLEM)


@click.command()
@json_option("The whole manifest")
def info(json_to: str | None) -> None:
    """Say what the installed sglang carries (its hardening manifest), and the CPython tag and
    machine it runs on.

    \b
    Example:
      sglang-hardened info --json
    """
    from ..runtime.identity import manifest, runs_on, shadowed_by

    found = manifest()
    if found is None:
        raise HardenedError("the installed sglang is not a hardened build (no hardening manifest)")
    if (other := shadowed_by()) is not None:
        raise HardenedError(f"this Python imports sglang from {other}, not the hardened wheel's files: an "
                            "editable install or a source tree on sys.path shadows it (uninstall it, or run elsewhere)")
    say(f"sglang {found['version']} (upstream {found['upstream']['file']}, "
        f"sha256 {found['upstream']['sha256']}), on {runs_on()}", json_to)
    say(format_table(("patch", "id", "sha256", "summary"),
                     [(p["name"], p["hardening_id"], p["sha256"][:16] + "…", p["summary"]) for p in found["patches"]]),
        json_to)
    write_json(json_to, {**found, "runs_on": runs_on()})


@click.group()
def policy() -> None:
    """The hardening policy: defaults applied by `launch` and the image, and every
    SGLANG_HARDENED_* variable.

    \b
    Example:
      sglang-hardened policy show --base 0.5.19
      sglang-hardened policy knobs
    """


@policy.command("show")
@click.option("--base", required=True, help="Upstream release, e.g. 0.5.19.")
def policy_show(base: str) -> None:
    """Print the knobs that apply to a base.

    \b
    Example:
      sglang-hardened policy show --base 0.5.23
    """
    from ..runtime.policy import knobs_for

    click.echo(format_table(("id", "knob", "value", "scope", "why"), [
        (k.id, k.name, k.value or "on", "PD only" if k.pd_only else "all", k.why.split(";")[0])
        for k in knobs_for(base)
    ]))


@policy.command("knobs")
@click.option("--markdown", is_flag=True, help="As the Markdown table docs/operating.md carries.")
def policy_knobs(markdown: bool) -> None:
    """Print every SGLANG_HARDENED_* variable: type, default, hardening id, who reads it, whether
    setting it weakens a guarantee, and what it does.

    \b
    Example:
      sglang-hardened policy knobs
      sglang-hardened policy knobs --markdown
    """
    from ..runtime.policy import KNOB_COLUMNS, knob_rows, knobs_markdown

    click.echo(knobs_markdown() if markdown else format_table(KNOB_COLUMNS, knob_rows()))


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--base", help="Upstream release whose policy applies (default: the installed sglang's).")
@click.option("--dry-run", is_flag=True, help="Print what would be set and the command; start nothing.")
@click.argument("sglang_args", nargs=-1, type=click.UNPROCESSED)
def launch(base: str | None, dry_run: bool, sglang_args: tuple[str, ...]) -> None:
    """Start SGLang's server with the hardening policy applied.

    Each value the policy sets, and each one you overrode, is logged.

    \b
    Example:
      sglang-hardened launch -- --model-path /models/llama --disaggregation-mode prefill
    """
    from .launch import exec_sglang, installed_base, plan

    result = plan(base or installed_base(), list(sglang_args), dict(os.environ))
    click.echo(format_table(("id", "knob", "value", "outcome"),
                            [(d.id, d.name, d.value, d.outcome) for d in result.decisions]), err=True)
    if dry_run:
        click.echo(" ".join(["python", "-m", "sglang.launch_server", *result.argv]))
        return
    exec_sglang(result)


@click.group()
def deploy() -> None:
    """The Kubernetes recipe (deploy/kubernetes/): check its parameters and wiring before applying it.

    \b
    Example:
      sglang-hardened deploy check deploy/kubernetes/params/params.env
    """


@deploy.command("drain")
@click.option("--url", default="http://127.0.0.1:30000", show_default=True, help="The server to drain.")
@click.option("--settle", type=float, default=5.0, show_default=True,
              help="Seconds for the gateway to see the pod marked for deletion and stop sending to it.")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Give up (exit 1) past this many seconds; keep it under the pod's grace period.")
def deploy_drain(url: str, settle: float, timeout: float) -> None:
    """Wait until a server holds no request and no KV page: the recipe's preStop hook, so a
    rollout or a node drain loses no request in flight.

    \b
    Example:
      sglang-hardened deploy drain --url http://127.0.0.1:30000 --timeout 600
    """
    from .drain import drain

    click.echo(f"deploy drain: {url} idle after {drain(url, settle, timeout):.0f} s")


@deploy.command("check")
@click.argument("params_file", type=click.Path(path_type=Path), default="deploy/kubernetes/params/params.env")
@click.option("--overlay", "overlays", multiple=True, type=click.Path(path_type=Path, file_okay=False),
              help="A kustomization to render and judge (repeatable); default: the recipe's lws and rbg "
                   "next to the parameter file's folder.")
def deploy_check(params_file: Path, overlays: tuple[Path, ...]) -> None:
    """Judge a parameter file with preflight's rules, and what each rendered overlay would run;
    exit 1 on any unsafe finding.

    Pool vs context on both roles, input limits equal across roles, the same
    page size, KV dtype and transfer backend, and a hardened image tag. Each
    overlay is rendered with `kubectl kustomize`: both roles must take the
    bootstrap token, and smg its control-plane key, from a Secret; every image
    is pinned; the model is mounted where --model-path reads it; smg finds each
    role's servers by their labels (with a Role that only reads pods) and the
    gate judges each; a multi-node group takes its place from LWS. The live
    servers are judged again by the gateway's preflight gate.

    \b
    Example:
      sglang-hardened deploy check deploy/kubernetes/params/params.env && kubectl apply -k deploy/kubernetes/lws
      sglang-hardened deploy check my-site/params.env --overlay my-site/
    """
    from .deploy_check import check, read_params
    from .deploy_shape import judge_images, judge_model, judge_rbac, judge_servers, servers, volumes_read
    from .deploy_wiring import judge_wiring, overlays_of, render, secrets_read

    params = read_params(params_file)
    rendered = {path: render(path) for path in overlays_of(params_file, list(overlays))}
    findings = check(params)
    for path, docs in rendered.items():
        where = os.path.relpath(path)
        findings += judge_wiring(docs, where) + judge_images(docs, where) + judge_servers(docs, where)
        findings += judge_model(servers(docs), params.values["MODEL_PATH"], where) + judge_rbac(docs, where)
    click.echo(format_table(("key", "value"), sorted(params.values.items())))
    click.echo()
    click.echo(format_table(("overlay", "servers (replicas x pods)", "what you create first"),
                            [(os.path.relpath(path),
                              ", ".join(f"{s.component} {s.replicas}x{s.size}" for s in sorted(servers(docs), key=lambda s: s.component, reverse=True)) or "-",
                              ", ".join([*(f"Secret {s}" for s in secrets_read(docs)),
                                         *(f"PVC {v}" for v in volumes_read(docs))]) or "-")
                             for path, docs in rendered.items()]))
    _echo_findings(findings)
    unsafe = any(f.severity == "unsafe" for f in findings)
    click.echo(f"\ndeploy check: {'UNSAFE' if unsafe else 'ok'}")
    if unsafe:
        sys.exit(1)
