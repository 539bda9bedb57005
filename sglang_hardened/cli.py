"""The `sglang-hardened` command: one group of every layer's commands (each layer's cli.py)."""

from __future__ import annotations

import sys

import click

from . import __version__
from .common.errors import HardenedError


class Group(click.Group):
    """Turns HardenedError into one clear line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except HardenedError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sglang-hardened")
def main() -> None:
    """Hardened SGLang builds for multi-tenant prefill/decode serving.

    \b
    Example:
      sglang-hardened build --base 0.5.23 --out dist/
    """


def _register() -> None:
    """Each layer's commands live beside the code they drive, in its own cli.py."""
    from .image.cli import image, verify_image
    from .lb.cli import lb
    from .model.cli import model
    from .operations.cli import canary, deploy, info, launch, policy, preflight
    from .pipeline.cli import build, fetch, rebase, upstream, verify
    from .sandbox.cli import sandbox

    for command in (fetch, verify, build, rebase, upstream, info, policy, launch, preflight, canary, deploy, image,
                    verify_image, lb, model, sandbox):
        main.add_command(command)


_register()
