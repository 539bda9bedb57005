"""H0: a hardened server says what it carries (start-up log line, server-info field, build_info metric).

Reads the manifest the build wrote into sglang's dist-info, through
importlib.metadata, so it works for any install layout and costs one file
read per process.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import platform
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from . import metrics

MANIFEST_NAME = "hardened-manifest.json"
INFO_ROUTES = ("/server_info", "/get_server_info")  # where a server serves server_info() (older releases: the second)

log = logging.getLogger("sglang_hardened")


@lru_cache(maxsize=1)
def manifest() -> dict | None:
    """The installed sglang's hardening manifest, or None for an upstream sglang."""
    try:
        text = metadata.distribution("sglang").read_text(MANIFEST_NAME)
    except metadata.PackageNotFoundError:
        return None
    return json.loads(text) if text else None


# runs_on() as a python3 -c program, for an interpreter that may have no sglang_hardened (an image's base)
RUNS_ON_PROBE = "import platform, sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]} {platform.machine()}')"


def runs_on() -> str:
    """The CPython tag and machine this process runs, e.g. ``cp312 x86_64``: which of upstream's
    wheels (one per CPython and architecture) a node needs."""
    return f"cp{sys.version_info.major}{sys.version_info.minor} {platform.machine()}"


def shadowed_by() -> str | None:
    """Where this Python imports sglang from when that is not the installed distribution's files
    (an editable install's source tree, or one on sys.path, as upstream's image keeps under
    /sgl-workspace): the manifest would then speak for code that does not run. None: it is."""
    spec = importlib.util.find_spec("sglang")  # finds, without running the package's __init__
    try:
        installed = Path(metadata.distribution("sglang").locate_file("sglang/__init__.py")).resolve()
    except metadata.PackageNotFoundError:
        return None
    if spec is None or spec.origin is None:
        return "nowhere (the installed distribution's files are not importable)"
    origin = Path(spec.origin).resolve()
    return None if origin == installed else str(origin)


def server_info() -> dict:
    """The `hardening` field of /server_info: enough for preflight to judge a node, with
    the release settings in effect in this server's environment (not its version's defaults)."""
    from .bootstrap_auth import token_set
    from .page_tags.switch import tags_on
    from .startup import deferred_release_on
    from .release_timeout import process_release_timeout_s

    found = manifest()
    if found is None:
        return {"hardened": False}
    return {
        "hardened": True,
        "version": found["version"],
        "base": found["base"],
        "hardening_ids": found["hardening_ids"],
        "patches": [p["name"] for p in found["patches"]],
        "tool_version": found["tool"]["version"],
        "deferred_decode_kv_release": deferred_release_on(),
        "release_timeout_s": process_release_timeout_s(),
        "page_tags": tags_on(),
        "bootstrap_token": token_set(),
        "runs_on": runs_on(),
        "metrics": metrics.health(),
    }


def startup_line() -> str:
    """One line an operator can grep for in a server's start-up log."""
    info = server_info()
    if not info["hardened"]:
        return "sglang-hardened: runtime layer present, but the installed sglang is not a hardened build"
    count = len(info["patches"])
    return (
        f"sglang-hardened: sglang {info['version']} carries {' '.join(info['hardening_ids'])} "
        f"({count} patch{'es' if count != 1 else ''}, tool {info['tool_version']})"
    )


def log_startup() -> None:
    """Seam called once by the HTTP server at launch, once SGLang has started its processes (and
    set up multiprocess metrics): the start-up line, then the metrics' zeros and build info."""
    log.info(startup_line())
    metrics.at_start(manifest())
