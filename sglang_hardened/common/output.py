"""How every command hands its verdict to a person and to a program: one meaning of
``--json`` and one set of exit codes, so a CronJob, a readiness probe or a script reads any
command the same way.

``--json`` alone prints the report as JSON on stdout (the table a person reads then goes to
stderr, so stdout parses); ``--json PATH`` writes it to PATH (whole or not at all) and keeps
the table on stdout.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import click

OK = 0
PROBLEM = 1  # the command judged, and found something wrong
# 2 is click's: the command was called wrongly
UNJUDGED = 3  # the command could not judge (a URL that did not answer, a report it could not read)
STDOUT = "-"


def json_option(what: str):
    """The ``--json [PATH]`` option, ``what`` naming the report."""
    return click.option("--json", "json_to", is_flag=False, flag_value=STDOUT, default=None, metavar="[PATH]",
                        help=f"{what} as JSON: on stdout with --json alone (the table then on stderr), or into PATH.")


def say(text: str, json_to: str | None) -> None:
    """A line for a person: on stderr while stdout carries the JSON."""
    click.echo(text, err=json_to == STDOUT)


def write_json(json_to: str | None, data: object) -> None:
    """The report where ``--json`` asked for it; a file is replaced whole or left as it was."""
    if json_to is None:
        return
    text = json.dumps(data, indent=1)
    if json_to == STDOUT:
        click.echo(text)
        return
    target = Path(json_to)
    if target.exists() and not target.is_file():  # /dev/stdout, a pipe: nothing to replace
        target.write_text(text + "\n")
        return
    fd, tmp = tempfile.mkstemp(dir=target.parent if str(target.parent) else ".", prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
