"""Every ``SGLANG_HARDENED_*`` environment variable, declared once, as SGLang's own
``srt/environ.py`` declares its variables: its type, default, the hardening id it serves, who sets
it, whether setting it weakens a guarantee, and the line docs/operating.md prints for it.

Code reads a knob through its declaration (``BOOTSTRAP_TOKEN.raw()``, ``PAGE_TAGS.get()``), never
through a name spelled again: ``tests/unit/test_knobs.py`` fails on any ``SGLANG_HARDENED_*`` name
in the repository that is not declared here, and on a name spelled in code outside this module.
A default that is one of the hardening policy's numbers is a ``Limit``: the number itself lives
in ``runtime/policy.yaml`` under the item that owns it, and ``runtime.policy.knob_value`` reads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "SGLANG_HARDENED_"
ROLES = {
    "server": "read by a hardened SGLang server (prefill or decode)",
    "image": "read by the hardened image",
    "tool": "read by the sglang-hardened command",
    "sandbox": "set by the CPU sandbox on what it starts",
    "test": "read by the test suite",
}
# What each type accepts (said to whoever sets something else: ``Knob.get`` refuses it, naming the
# knob); a flag is on with 1 and off unset, empty or 0: anything else (a "true" meant to turn a
# hardening on) is refused rather than read as off.
TYPES = {
    "flag": "set it to 1 or leave it unset",
    "on|off": "use on or off",
    "int": "give a whole number, 0 or more",
    "float": "give a number",
    "path": "give a path",
    "text": "give text",
    "secret": "give text (never logged)",
}


@dataclass(frozen=True)
class Limit:
    """A default that is a number of ``runtime/policy.yaml``'s ``limits``: ``limits[item][key]``."""

    item: str
    key: str

    def __str__(self) -> str:
        return f"policy.yaml `limits: {self.item}: {self.key}`"


Default = str | int | float | Limit | None


@dataclass(frozen=True)
class Knob:
    """One environment variable: what it is and how it is read."""

    name: str
    type: str
    default: Default
    id: str | None  # the hardening id it serves; None for the tool's and the tests' own
    role: str
    weakens: bool  # setting it away from its default gives up part of a hardening guarantee
    doc: str

    def __post_init__(self) -> None:
        if not self.name.startswith(PREFIX) or self.type not in TYPES or self.role not in ROLES:
            raise ValueError(f"knob {self.name}: a name under {PREFIX}, a type of {sorted(TYPES)}, "
                             f"a role of {sorted(ROLES)}")

    def raw(self, environ: Mapping[str, str] = os.environ) -> str | None:
        """The value as set, or None."""
        return environ.get(self.name)

    def get(self, environ: Mapping[str, str] = os.environ, default: Default = None):
        """The value as its type, else the default (``default`` stands in for a ``Limit``, which
        only ``runtime.policy.knob_value`` resolves). A value its type does not accept is an error
        naming the knob: a typo must not turn a hardening off or a bound into nonsense."""
        fallback = self.default if default is None else default
        if isinstance(fallback, Limit):
            raise TypeError(f"{self.name}: its default is {fallback}; read it with runtime.policy.knob_value")
        raw = self.raw(environ)
        if self.type == "flag" and (raw or "0") in ("0", "1"):
            return raw == "1"
        if raw is None:
            return fallback
        value = raw.strip()
        if self.type == "on|off" and value.lower() in ("on", "off"):
            return value.lower() == "on"
        if self.type == "int" and value.isdigit():
            return int(value)
        if self.type == "float":
            try:
                return float(value)
            except ValueError:
                pass
        if self.type in ("path", "text", "secret"):
            return raw
        raise ValueError(f"sglang-hardened{' ' + self.id if self.id else ''}: {self.name}={raw!r}: "
                         f"{TYPES[self.type]}")


# --- the server's: set on prefill and decode, read by runtime/ ---

BOOTSTRAP_TOKEN = Knob(
    "SGLANG_HARDENED_BOOTSTRAP_TOKEN", "secret", None, "H14", "server", False,
    "the secret prefill's bootstrap server asks of every registration, and decode sends to H4's outcome "
    "route; set the same value on both roles")
ALLOW_UNSAFE_KV_LIMITS = Knob(
    "SGLANG_HARDENED_ALLOW_UNSAFE_KV_LIMITS", "flag", None, "H7", "server", True,
    "start a PD server whose KV pool is smaller than its context, or serve a prefill whose input limit is "
    "below decode's, instead of refusing (logged)")
ALLOW_EARLY_RELEASE = Knob(
    "SGLANG_HARDENED_ALLOW_EARLY_RELEASE", "flag", None, "H5", "server", True,
    "start a PD server with deferred decode KV release off instead of refusing (logged)")
ALLOW_TOKENIZER_WORKERS = Knob(
    "SGLANG_HARDENED_ALLOW_TOKENIZER_WORKERS", "flag", None, "H4", "server", True,
    "start a prefill with several tokenizer workers, without H4's notice of ended requests to decode (logged)")
PAGE_TAGS = Knob(
    "SGLANG_HARDENED_PAGE_TAGS", "on|off", "on", "H8", "server", True,
    "off switches H8's page tags off on that server, only to measure their cost (a warning at start-up; "
    "preflight reports the server unsafe)")
PAGE_TAGS_FAIL_CLOSED = Knob(
    "SGLANG_HARDENED_PAGE_TAGS_FAIL_CLOSED", "flag", None, "H8", "server", False,
    "after one tag mismatch, decode admits no more requests until restarted")
PAGE_TAGS_COST_EVERY = Knob(
    "SGLANG_HARDENED_PAGE_TAGS_COST_EVERY", "int", Limit("H8", "cost_report_every"), "H8", "server", False,
    "requests per log line of H8's own cost in the server (0: off)")
TRANSFER_MAX_ENTRIES = Knob(
    "SGLANG_HARDENED_TRANSFER_MAX_ENTRIES", "int", Limit("H6", "max_entries_per_call"), "H6", "server", False,
    "entries per synchronous Mooncake call, whatever the layer count (under Mooncake TCP's per-call limit)")
TRANSFER_LINK_RATE = Knob(
    "SGLANG_HARDENED_TRANSFER_LINK_RATE", "float", Limit("H6", "link_rate_bytes_per_s"), "H6", "server", False,
    "bytes/s one Mooncake call is sized for: it carries at most `timeout_fraction` of the release timeout "
    "at this rate; raise it on fast links")
SEAM_COST_DIR = Knob(
    "SGLANG_HARDENED_SEAM_COST_DIR", "path", None, None, "server", False,
    "a directory holding `seams.json`: each process times the seams listed there and writes its totals "
    "into it (benchmarks/bench_seam_cost.py)")

# --- the image's ---

HEALTH_PORT = Knob(
    "SGLANG_HARDENED_HEALTH_PORT", "int", 30000, None, "image", False,
    "the port the image's HEALTHCHECK asks `/health` on: set it when you pass another `--port`")

# --- the tool's ---

CACHE = Knob(
    "SGLANG_HARDENED_CACHE", "path", "$XDG_CACHE_HOME/sglang-hardened", None, "tool", False,
    "where downloads, builds and sandbox environments are kept (`~/.cache/sglang-hardened` without "
    "XDG_CACHE_HOME)")
PATCHES = Knob(
    "SGLANG_HARDENED_PATCHES", "path", "the checkout's patches/", None, "tool", False,
    "the patch tree (each base's series, `upstream.lock`) the pipeline reads: set it for an installed tool")
UPSTREAM_RELEASES = Knob(
    "SGLANG_HARDENED_UPSTREAM_RELEASES", "text", None, None, "tool", False,
    "comma-separated releases `upstream check` takes as the package index's list (tests; ci/upstream-rebase)")

# --- the sandbox's and the tests' ---

SANDBOX = Knob(
    "SGLANG_HARDENED_SANDBOX", "text", None, None, "sandbox", False,
    "a sandbox cluster's run id, on every process it starts, so `sandbox down` and the tests find them")
E2E_MATRIX = Knob(
    "SGLANG_HARDENED_E2E_MATRIX", "text", None, None, "test", False,
    "full: every e2e scenario on every base and backend (hours)")
SUITE_STARTED = Knob(
    "SGLANG_HARDENED_SUITE_STARTED", "int", None, None, "test", False,
    "epoch seconds `scripts/test` started a whole tier at: such a run is held to tests/budget.toml")
TEST_SESSION = Knob(
    "SGLANG_HARDENED_TEST_SESSION", "text", None, None, "test", False,
    "a test session's mark, inherited by every process it starts: the leftovers check judges those only")

KNOBS: tuple[Knob, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Knob))
