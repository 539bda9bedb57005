"""The wheel pipeline's commands: fetch, verify, build, rebase, upstream (parsing and printing only)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from packaging.version import InvalidVersion, Version

from .. import __version__
from ..common.errors import HardenedError
from ..common.knobs import UPSTREAM_RELEASES
from ..common.paths import patches_dir
from ..common.table import format_table
from .fetch import ARCHES
from .lock import get_wheels, load_lock


def _bases(base: str | None, all_bases: bool) -> list[str]:
    if all_bases == bool(base):
        raise click.UsageError("give exactly one of --base V or --all")
    return list(load_lock(patches_dir())) if all_bases else [base]


def _progress(message: str) -> None:
    click.echo(f"  {message}", err=True)


@click.command()
@click.option("--base", help="Upstream release, e.g. 0.5.23.")
@click.option("--all", "all_bases", is_flag=True, help="Every supported base.")
@click.option("--refresh", is_flag=True, help="Download again even if cached.")
def fetch(base: str | None, all_bases: bool, refresh: bool) -> None:
    """Download the pinned upstream wheels (every CPython and architecture), verify each
    sha256 and cache them.

    \b
    Example:
      sglang-hardened fetch --base 0.5.19
    """
    from .fetch import fetch_wheel

    patches = patches_dir()
    rows = []
    for name in _bases(base, all_bases):
        for pin in get_wheels(patches, name):
            path = fetch_wheel(pin, refresh=refresh, quiet=False)
            rows.append((name, pin.python, pin.arch, pin.sha256[:16] + "…", path))
    click.echo(format_table(("base", "python", "arch", "sha256", "cached at"), rows))


@click.command()
@click.option("--base", help="Upstream release, e.g. 0.5.23.")
@click.option("--all", "all_bases", is_flag=True, help="Every supported base.")
@click.option("--seams-index", type=click.Path(path_type=Path), metavar="PATH",
              help="Also write where each patch calls the runtime, per base, as Markdown (docs/seams.md).")
def verify(base: str | None, all_bases: bool, seams_index: Path | None) -> None:
    """Check each series: headers, listing, the seam rule, and a dry run on the pinned upstream.

    \b
    Example:
      sglang-hardened verify --all
      sglang-hardened verify --all --seams-index docs/seams.md
    """
    from .seams import index_markdown
    from .verify import verify_and_index

    patches = patches_dir()
    checked = {name: verify_and_index(patches, name) for name in _bases(base, all_bases)}
    rows = [r for found, _ in checked.values() for r in found]
    if seams_index is not None:
        seams_index.write_text(index_markdown({name: sites for name, (_, sites) in checked.items()}))
    click.echo(format_table(("base", "patch", "id", "status"),
                            [(r.base, r.patch, r.hardening_id, r.status) for r in rows]))
    if not all(r.ok for r in rows):
        sys.exit(1)


@click.command()
@click.option("--base", help="Upstream release, e.g. 0.5.23.")
@click.option("--all", "all_bases", is_flag=True, help="Every supported base.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("dist"),
              show_default=True, help="Directory for the wheels.")
@click.option("--python", "pythons", multiple=True, metavar="3.X",
              help="Only the wheels for this CPython (repeatable; default: every one upstream ships).")
@click.option("--arch", "arches", multiple=True, type=click.Choice(ARCHES),
              help="Only the wheels for this machine (repeatable; default: every one upstream ships).")
def build(base: str | None, all_bases: bool, out_dir: Path, pythons: tuple[str, ...], arches: tuple[str, ...]) -> None:
    """Build hardened sglang wheels, one per wheel upstream ships (each CPython and
    architecture), plus the sglang-hardened wheel.

    Output appears all together or not at all. Install the result with
    pip install --no-index --no-deps --find-links DIR "sglang==V+hardened.N"
    (pip picks the wheel for the Python and machine in use).

    \b
    Examples:
      sglang-hardened build --base 0.5.23 --out dist/
      sglang-hardened build --all --python 3.12 --arch x86_64
    """
    from .build import build as run_build

    tags = {f"cp{v.replace('.', '')}" for v in pythons}

    def choose(wheels: list) -> list:
        return [w for w in wheels if (not tags or w.python in tags) and (not arches or w.arch in arches)]

    bases = _bases(base, all_bases)
    results, tool = run_build(bases, out_dir, progress=_progress, choose=choose)
    rows = [(r.base, r.version, " ".join(r.manifest["hardening_ids"]), r.wheel) for r in results]
    rows.append(("-", __version__, "-", tool))
    click.echo(format_table(("base", "version", "hardening", "wheel"), rows))


@click.command()
@click.option("--from", "source", required=True, help="Base whose series is carried, e.g. 0.5.23.")
@click.option("--to", "target", required=True, help="Newer upstream release, e.g. 0.5.24.")
@click.option("--force", is_flag=True, help="Replace an existing series for the target.")
@click.option("--report", type=click.Path(path_type=Path), help="Also write a markdown report here.")
@click.option("--rejects", type=click.Path(path_type=Path), default=Path("rebase-rejects"),
              show_default=True, help="Where conflicting files' three-way merges go.")
def rebase(source: str, target: str, force: bool, report: Path | None, rejects: Path) -> None:
    """Carry a series onto a newer upstream release and say, per patch, what happened.

    Verdicts: applies, applies with offset, applies (3-way merge), already
    upstream (dropped, recorded as Applied-Upstream), conflict (the merge with
    its markers is written out; nothing else is written; exit 1).

    \b
    Example:
      sglang-hardened rebase --from 0.5.23 --to 0.5.24 --report rebase.md
    """
    from .rebase import rebase as run_rebase
    from .rebase import write_rejects, write_series

    patches = patches_dir()
    click.echo(f"carrying {source}'s series onto {target}…", err=True)
    result = run_rebase(patches, source, target)
    rows = [(v.patch.name, v.patch.hardening_id, v.verdict, v.detail) for v in result.verdicts]
    table = format_table(("patch", "id", "verdict", "detail"), rows)
    click.echo(table)
    if report:
        report.write_text(f"# Rebase of {source}'s series onto {target}\n\n"
                          + "| patch | id | verdict | detail |\n|---|---|---|---|\n"
                          + "".join(f"| {' | '.join(map(str, r))} |\n" for r in rows))
    if not result.clean:
        for path in write_rejects(result, rejects):
            click.echo(f"conflict written to {path}", err=True)
        raise HardenedError(f"rebase onto {target} needs a human: conflicts above; nothing written")
    click.echo(f"wrote {write_series(patches, result, force=force)}")


@click.group()
def upstream() -> None:
    """Upstream releases as the package index lists them.

    \b
    Example:
      sglang-hardened upstream check
    """


def _releases(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[Version] | None:
    """--releases as versions; None (not given): ask the index."""
    if value is None:
        return None
    try:
        return [Version(v) for v in value.split(",")]
    except InvalidVersion as exc:
        raise click.BadParameter(str(exc)) from None


@upstream.command("check")
@click.option("--releases", envvar=UPSTREAM_RELEASES.name, show_envvar=True, callback=_releases,
              help="Comma-separated releases to take as the index's list instead of asking it "
                   "(a fixed upstream for tests; ci/upstream-rebase passes the variable on).")
def upstream_check(releases: list[Version] | None) -> None:
    """List releases newer than the newest supported base (exit 0 either way).

    \b
    Example:
      sglang-hardened upstream check
    """
    from .upstream import newer_releases

    newer = newer_releases(patches_dir(), releases)
    click.echo("\n".join(newer) if newer else "no release newer than the newest supported base")


@upstream.command("prs")
@click.option("--base", required=True, help="The series whose Bug: pull requests are looked up.")
@click.option("--release", required=True, help="The release to look for them in, e.g. 0.5.24.")
def upstream_prs(base: str, release: str) -> None:
    """Say, as markdown, whether RELEASE contains each upstream pull request a patch stands in for.

    Asks GitHub through `gh` (GH_TOKEN). Prints nothing when no patch names one.

    \b
    Example:
      sglang-hardened upstream prs --base 0.5.23 --release 0.5.24 >> rebase-report.md
    """
    from .publish import pr_table, run_command, upstream_prs as find_prs

    click.echo(pr_table(find_prs(patches_dir(), base), release, run_command), nl=False)


@upstream.command("publish")
@click.option("--outcome", required=True, type=click.Choice(["carried", "needs-human"]),
              help="carried: push a branch and open its pull request; needs-human: open or update the job's issue.")
@click.option("--release", required=True, help="The release carried, or the one that needs a human.")
@click.option("--report", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The job's markdown report: the pull request's or issue's description.")
@click.option("--rejects", type=click.Path(path_type=Path), default=Path("rebase-rejects"), show_default=True,
              help="needs-human: the folder of RELEASE's three-way merges (rebase --rejects).")
def upstream_publish(outcome: str, release: str, report: Path, rejects: Path) -> None:
    """Tell the maintainers on GitHub what the rebase job found, through `git` and `gh`.

    \b
    Example:
      sglang-hardened upstream publish --outcome carried --release 0.5.24 --report rebase-report.md
    """
    from .publish import publish_carried, publish_needs_human, run_command

    text = report.read_text()
    click.echo(publish_carried(release, text, patches_dir(), run_command) if outcome == "carried"
               else publish_needs_human(release, text, rejects / release, run_command))
