"""`sglang-hardened image`: parsing and printing only; the work lives in build.py."""

from __future__ import annotations

from pathlib import Path

import click

from ..common.table import format_table


def _pairs(values: tuple[str, ...]) -> dict[str, str]:
    if any("=" not in value for value in values):
        raise click.BadParameter(f"build args are KEY=VALUE, got {', '.join(values)}")
    return dict(value.split("=", 1) for value in values)


@click.command()
@click.option("--base", required=True, help="Upstream release, e.g. 0.5.23.")
@click.option("--engine", type=click.Choice(("docker", "buildah")),
              help="Default: Docker where its daemon answers, else buildah.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("dist"),
              show_default=True, help="Directory of the wheels (built there unless current).")
@click.option("--base-image", help="Build on this image instead of upstream's docker.io/lmsysorg/sglang:v<base> "
                                   "(with --tool: instead of Dockerfile.tool's Python).")
@click.option("--tag", help="Image name. Default: sglang-hardened:<base>-hardened.<n>.")
@click.option("--signing-key", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="PEM private key (ECDSA P-256 or RSA) to sign the provenance and SBOM with, into "
                   "<tag>.intoto.jsonl beside the wheels. CI signs keyless instead (docs/image.md).")
@click.option("--tool", "tool_only", is_flag=True,
              help="The slim tool image instead (Dockerfile.tool: the tool wheel on a small Python, for the "
                   "gate and the canary), tagged and labelled as the servers' image of the same base.")
@click.option("--build-arg", "extra_args", multiple=True, metavar="KEY=VALUE",
              help="Another build arg (repeatable), e.g. PIP_NO_INDEX=1 for --tool on a base that has its dependencies.")
def image(base: str, engine: str | None, out_dir: Path, base_image: str | None, tag: str | None,
          signing_key: Path | None, tool_only: bool, extra_args: tuple[str, ...]) -> None:
    """Build the hardened image: the wheels (if not current), then the Dockerfile, then the
    image's CycloneDX SBOM and SLSA provenance beside the wheels.

    \b
    Example:
      sglang-hardened image --base 0.5.23
      sglang-hardened image --base 0.5.23 --signing-key release.pem
      sglang-hardened image --base 0.5.23 --tool       # sglang-hardened-tool:0.5.23-hardened.<n>
    """
    from .build import build_image

    built = build_image(base, out_dir, engine=engine, base_image=base_image, tag=tag, signing_key=signing_key,
                        tool_only=tool_only, extra_args=_pairs(extra_args),
                        progress=lambda msg: click.echo(f"  {msg}", err=True))
    click.echo(format_table(("image", "engine", "version", "hardening", "id"),
                            [(built.tag, built.engine, built.args["HARDENED_VERSION"], built.args["HARDENING_IDS"],
                              built.image_id[:19])]))
    click.echo("\n".join(f"wrote {path}" for path in built.files))


@click.command("verify-image")
@click.option("--image", "tag", required=True, help="The image, as the build named it.")
@click.option("--key", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The signing key's PEM public key (or the private key itself).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("dist"), show_default=True,
              help="Where the build wrote the image's SBOM and attestations.")
@click.option("--engine", type=click.Choice(("docker", "buildah")),
              help="Default: Docker where its daemon answers, else buildah.")
def verify_image(tag: str, key: Path, out_dir: Path, engine: str | None) -> None:
    """Check offline that the image's signed provenance and SBOM are about this very image (its
    ID, read from the engine), signed by KEY, and the SBOM beside it unchanged; exit 1 if not.

    \b
    Example:
      sglang-hardened verify-image --image sglang-hardened:0.5.23-hardened.14 --key release.pub
    """
    from .attest import public_key, verify_image as verify
    from .build import attestation_files
    from .engine import digests, pick_engine

    image_id = digests(engine or pick_engine(), tag)[0]
    sbom, _, signed = attestation_files(out_dir, tag)
    statements = verify(signed, sbom, public_key(key), image_id)
    click.echo(f"{tag} ({image_id}): {len(statements)} attestations signed by the key, "
               f"{', '.join(s['predicateType'] for s in statements)}; {sbom.name} as signed")
