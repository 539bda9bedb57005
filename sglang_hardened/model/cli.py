"""``model``: check the PD KV-page protocol model from the command line.

A click group the top-level ``sglang-hardened`` CLI registers; it can also
be run alone: ``python -c "from sglang_hardened.model.cli import model; model()"``.
"""

from __future__ import annotations

import click

from .checker import CheckResult, check
from ..common.table import format_table as format_rows
from .configs import NAMED, SCENARIOS, WIDE_SCENARIOS, Agreement, Config, parse_config
from .necessity import kinds_at, necessity
from .report import format_finding, format_table
from .state import Scenario


def _bounds_line(wide: bool) -> str:
    scenarios = WIDE_SCENARIOS if wide else SCENARIOS
    parts = [
        f"{sc.name} ({len(sc.requests)} requests, {sc.pool_pages} pages, "
        + f"{sc.faults} fault{'s' if sc.faults != 1 else ''}"
        + (f", {sc.ranks} ranks per role)" if sc.ranks > 1 else ")")
        for sc in scenarios
    ]
    return "bounds: " + "; ".join(parts)


@click.group()
def model() -> None:
    """Explicit-state model of prefill/decode KV pages, transfers and aborts.

    \b
    Example:
      sglang-hardened model check --config upstream-0.5.19
    """


@model.command("check")
@click.option(
    "--config",
    "names",
    multiple=True,
    metavar="NAME",
    help="A named configuration (see --list) or switches like 'H1,H3,H5' "
    "('none' for none). Repeatable.",
)
@click.option(
    "--all",
    "check_all",
    is_flag=True,
    help="Check every named configuration; exit 0 when each gives the "
    "result it is expected to (upstream violated, hardened clean).",
)
@click.option(
    "--list", "list_only", is_flag=True, help="List the named configurations."
)
@click.option(
    "--wide", is_flag=True, help="Add the wide scenarios (about 10x slower)."
)
def check_cmd(
    names: tuple[str, ...], check_all: bool, list_only: bool, wide: bool
) -> None:
    """Check configurations exhaustively within the bounds.

    Prints a table (config, states explored, result, seconds), then a
    numbered trace for every broken property. Exits 0 when nothing is
    broken, 1 otherwise (with --all: when any result is not the expected one).

    \b
    Examples:
      sglang-hardened model check --config upstream-0.5.19
      sglang-hardened model check --config hardened-0.5.23 --config H1,H2,H5
      sglang-hardened model check --all
      sglang-hardened model check --list
    """
    if list_only:
        for cfg in NAMED.values():
            click.echo(
                f"{cfg.name:<16} {','.join(sorted(cfg.switches)) or 'none':<24} {cfg.summary}"
            )
        return
    if check_all == bool(names):
        raise click.UsageError("give --config NAME (repeatable), --all or --list")
    try:
        configs = (
            list(NAMED.values()) if check_all else [parse_config(n) for n in names]
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from None
    scenarios = WIDE_SCENARIOS if wide else SCENARIOS
    click.echo(_bounds_line(wide))
    results = _check_each(configs, scenarios)
    click.echo(format_table(results))
    if check_all:
        wrong = [r.config.name for r in results if r.clean != r.config.expect_clean]
        if wrong:
            click.echo(f"unexpected result for: {', '.join(wrong)}")
            raise SystemExit(1)
        click.echo("every configuration gives its expected result")
        return
    for res in results:
        for finding in res.findings:
            click.echo(f"\n[{res.config.name}] {format_finding(finding)}")
    if any(not r.clean for r in results):
        raise SystemExit(1)


def _check_each(configs: list[Config], scenarios: tuple[Scenario, ...]) -> list[CheckResult]:
    """Each configuration's result; configurations that mean the same machine (every hardened
    base) are explored once and share it."""
    explored: dict[tuple, CheckResult] = {}
    results = []
    for cfg in configs:
        if cfg.machine not in explored:
            explored[cfg.machine] = check(cfg, scenarios)
        res = explored[cfg.machine]
        results.append(CheckResult(cfg, res.results, res.seconds))
    return results


@model.command("necessity")
@click.option(
    "--wide", is_flag=True, help="Add the wide scenarios (about 10x slower)."
)
def necessity_cmd(wide: bool) -> None:
    """Show, per item, what turning it off does to the hardened model,
    with one rank per role and with two.

    An item is necessary when turning it off alone breaks a property; an
    item covered by another must leave the model clean when off alone and
    break it when off together with its cover. The last rows are the
    decisions decode's ranks must share (release, tag verdict): no-ops with
    one rank, necessary with two. Exits 1 if any claim fails.

    \b
    Example:
      sglang-hardened model necessity
    """
    click.echo(_bounds_line(wide))
    verdicts = necessity(WIDE_SCENARIOS if wide else SCENARIOS)
    rows, notes = [], []
    for v in verdicts:
        if isinstance(v.item, Agreement):
            name, claim = f"{v.item.value} agreement", "necessary with two ranks"
        elif v.with_cover is None:
            name, claim = v.item.value, "necessary"
        else:
            cover = ",".join(sorted(v.cover))
            name, claim = v.item.value, f"covered by {cover} (off with it: {_kinds(v.with_cover.kinds)})"
            notes.append(f"{v.item.value}: {v.reason}")
        if not v.holds:
            claim += "  [CLAIM FAILS]"
        rows.append((name, _kinds(kinds_at(v.alone, 1)), _kinds(kinds_at(v.alone, 2)), claim))
    click.echo(format_rows(("off alone", "one rank", "two ranks", "verdict"), rows))
    click.echo("\n".join(notes))
    if not all(v.holds for v in verdicts):
        raise SystemExit(1)


def _kinds(kinds: list[str]) -> str:
    return ", ".join(kinds) or "clean"
