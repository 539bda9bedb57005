"""The `sglang-hardened` command: parsing and printing only; the work lives in modules."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import __version__
from .errors import HardenedError
from .image_command import image
from .lock import get_pin, load_lock
from .paths import patches_dir
from .table import format_table


class Group(click.Group):
    """Turns HardenedError into one clear line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except HardenedError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)


def _bases(base: str | None, all_bases: bool) -> list[str]:
    if all_bases == bool(base):
        raise click.UsageError("give exactly one of --base V or --all")
    return list(load_lock(patches_dir())) if all_bases else [base]


def _progress(message: str) -> None:
    click.echo(f"  {message}", err=True)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sglang-hardened")
def main() -> None:
    """Hardened SGLang builds for multi-tenant prefill/decode serving.

    \b
    Example:
      sglang-hardened build --base 0.5.23 --out dist/
    """


@main.command()
@click.option("--base", help="Upstream release, e.g. 0.5.23.")
@click.option("--all", "all_bases", is_flag=True, help="Every supported base.")
@click.option("--refresh", is_flag=True, help="Download again even if cached.")
def fetch(base: str | None, all_bases: bool, refresh: bool) -> None:
    """Download the pinned upstream wheel, verify its sha256 and cache it.

    \b
    Example:
      sglang-hardened fetch --base 0.5.19
    """
    from .fetch import fetch_wheel

    patches = patches_dir()
    rows = []
    for name in _bases(base, all_bases):
        pin = get_pin(patches, name)
        path = fetch_wheel(pin, refresh=refresh, quiet=False)
        rows.append((name, pin.sha256[:16] + "…", path))
    click.echo(format_table(("base", "sha256", "cached at"), rows))


@main.command()
@click.option("--base", help="Upstream release, e.g. 0.5.23.")
@click.option("--all", "all_bases", is_flag=True, help="Every supported base.")
def verify(base: str | None, all_bases: bool) -> None:
    """Check each series: headers, listing, and a dry run on the pinned upstream.

    \b
    Example:
      sglang-hardened verify --all
    """
    from .verify import verify_base

    patches = patches_dir()
    rows = [r for name in _bases(base, all_bases) for r in verify_base(patches, name)]
    click.echo(format_table(("base", "patch", "id", "status"),
                            [(r.base, r.patch, r.hardening_id, r.status) for r in rows]))
    if not all(r.ok for r in rows):
        sys.exit(1)


@main.command()
@click.option("--base", help="Upstream release, e.g. 0.5.23.")
@click.option("--all", "all_bases", is_flag=True, help="Every supported base.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("dist"),
              show_default=True, help="Directory for the wheels.")
def build(base: str | None, all_bases: bool, out_dir: Path) -> None:
    """Build hardened sglang wheel(s) plus the sglang-hardened wheel.

    Output appears all together or not at all. Install the result with
    pip install --no-index --no-deps --find-links DIR "sglang==V+hardened.N" sglang-hardened

    \b
    Example:
      sglang-hardened build --base 0.5.23 --out dist/
    """
    from .build import build as run_build

    bases = _bases(base, all_bases)
    results, tool = run_build(bases, out_dir, progress=_progress)
    rows = [(r.base, r.version, " ".join(r.manifest["hardening_ids"]), r.wheel) for r in results]
    rows.append(("-", __version__, "-", tool))
    click.echo(format_table(("base", "version", "hardening", "wheel"), rows))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
def info(as_json: bool) -> None:
    """Say what the installed sglang carries (its hardening manifest).

    \b
    Example:
      sglang-hardened info --json
    """
    from .runtime.identity import manifest

    found = manifest()
    if found is None:
        raise HardenedError("the installed sglang is not a hardened build (no hardening manifest)")
    if as_json:
        click.echo(json.dumps(found, indent=2, sort_keys=True))
        return
    click.echo(f"sglang {found['version']} (upstream {found['upstream']['file']}, "
               f"sha256 {found['upstream']['sha256']})")
    click.echo(format_table(("patch", "id", "sha256", "summary"),
                            [(p["name"], p["hardening_id"], p["sha256"][:16] + "…", p["summary"])
                             for p in found["patches"]]))


main.add_command(image)
