"""`sglang-hardened image`: parsing and printing only; the work lives in build.py."""

from __future__ import annotations

from pathlib import Path

import click

from ..common.table import format_table


@click.command()
@click.option("--base", required=True, help="Upstream release, e.g. 0.5.23.")
@click.option("--engine", type=click.Choice(("docker", "buildah")),
              help="Default: Docker where its daemon answers, else buildah.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("dist"),
              show_default=True, help="Directory of the wheels (built there unless current).")
@click.option("--base-image", help="Build on this image instead of upstream's docker.io/lmsysorg/sglang:v<base>.")
@click.option("--tag", help="Image name. Default: sglang-hardened:<base>-hardened.<n>.")
def image(base: str, engine: str | None, out_dir: Path, base_image: str | None, tag: str | None) -> None:
    """Build the hardened image: the wheels (if not current), then the Dockerfile.

    \b
    Example:
      sglang-hardened image --base 0.5.23
    """
    from .build import build_image

    tag, engine, args = build_image(base, out_dir, engine=engine, base_image=base_image, tag=tag,
                                    progress=lambda msg: click.echo(f"  {msg}", err=True))
    click.echo(format_table(("image", "engine", "version", "hardening"),
                            [(tag, engine, args["HARDENED_VERSION"], args["HARDENING_IDS"])]))
