"""The one check of a URL an operator command sends HTTP requests to: ``http(s)://host[:port][/path]``.

urllib takes anything and fails late, as a traceback: "foo" is an unknown url type, a port that
is not a number an ``InvalidURL``, and ``ftp://`` goes to its FTP handler. A click callback
turns each into a usage error naming the option before any request is sent.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import click


def http_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Click callback: ``value`` unchanged if it is ``http(s)://host[:port][/path]`` (or not given)."""
    if value is None:
        return None
    try:
        parts = urlsplit(value)
        ok = (parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
              and not (parts.query or parts.fragment or parts.username or parts.password))
    except ValueError:  # .port on a non-number or out of range, a bracket left open
        ok = False
    if not ok:
        raise click.BadParameter(f"{value!r} is not http(s)://host[:port][/path]", ctx, param)
    return value
