"""Preflight of a live PD deployment: ask every node what it runs and judge it.

Reads GET /server_info (or /get_server_info on releases that only have
that) from each prefill and decode node, and GET /hardened/limits from each
prefill's bootstrap server (hardened nodes only; it is the input limit a
hardened decode compares its own with, shown beside the node's own and not judged: a
caller the network keeps off that port, as the recipe's gate, skips it). Findings are ``unsafe`` (exit
non-zero: the deployment can show one tenant's data to another or hang a
client) or ``warn`` (a defence that is off or cannot be observed); each
carries its remedy.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlparse

from packaging.version import InvalidVersion, Version

from ..common.knobs import BOOTSTRAP_TOKEN, PAGE_TAGS
from ..common.errors import HardenedError
from ..runtime.identity import INFO_ROUTES
from ..runtime.policy import knobs_for
from ..runtime.startup import DEFERRED_ENV, LIMITS_ROUTE

CHECKSUM_FIELD = "disaggregation_enable_kv_checksum"
CHECKSUM_FLAG = "--disaggregation-enable-kv-checksum"
DEFERRED_DEFAULT_ON = Version("0.5.21")  # upstream turned it on by default in 0.5.21
# Both roles must lay pages out alike, or decode reads prefill's bytes as something else.
LAYOUT_FIELDS = ("page_size", "kv_cache_dtype", "dtype", "enable_page_major_kv_layout")


@dataclass(frozen=True)
class Node:
    role: str
    url: str
    info: dict | None  # None when unreachable
    error: str = ""
    bootstrap_limit: int | None = None  # a hardened prefill's registered input limit

    def get(self, key: str, default: object = None) -> object:
        return (self.info or {}).get(key, default)

    @property
    def hardening(self) -> dict:
        return self.get("hardening") or {"hardened": False}

    @property
    def base(self) -> str:
        return str(self.hardening.get("base") or self.get("version", "?"))


@dataclass(frozen=True)
class Finding:
    severity: str  # "unsafe" or "warn"
    where: str
    what: str
    remedy: str


@dataclass
class Report:
    nodes: list[Node]
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.severity == "unsafe" for f in self.findings)

    @property
    def unjudged_only(self) -> bool:
        """Every unsafe finding is a node that did not answer: nothing was judged there."""
        silent = {f"{n.role} {n.url}" for n in self.nodes if n.info is None}
        return not self.ok and all(f.where in silent for f in self.findings if f.severity == "unsafe")

    def to_json(self) -> dict:
        return {"ok": self.ok, "unjudged": self.unjudged_only, "findings": [f.__dict__ for f in self.findings],
                "nodes": [{"role": n.role, "url": n.url, "error": n.error, "bootstrap_limit": n.bootstrap_limit,
                           **dict(zip(NODE_COLUMNS[2:], node_row(n)[2:]))} for n in self.nodes]}


def _get_json(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.load(reply)


def probe(role: str, url: str, timeout: float = 10.0, bootstrap: bool = True) -> Node:
    """What one node reports; an unreachable node comes back with ``error`` set. ``bootstrap``:
    read a prefill's registered limit from its bootstrap port too."""
    url = url.rstrip("/")
    info, error = None, ""
    for route in INFO_ROUTES:
        try:
            info = _get_json(url + route, timeout)
            break
        except (OSError, ValueError) as exc:
            error = f"{route}: {exc}"
    if info is None:
        return Node(role, url, None, error)
    limit = None
    if bootstrap and role == "prefill" and info.get("disaggregation_bootstrap_port"):
        host = urlparse(url).hostname
        try:
            limit = _get_json(f"http://{host}:{info['disaggregation_bootstrap_port']}{LIMITS_ROUTE}",
                              timeout).get("max_req_input_len")
        except (OSError, ValueError):
            limit = None  # upstream bootstrap servers have no such route
    return Node(role, url, info, "", limit)


def _deferred_release(node: Node) -> str:
    """What the node says is in effect (a hardened build's /server_info), else its version's default."""
    live = node.hardening.get("deferred_decode_kv_release")
    if isinstance(live, bool):
        return "on" if live else "OFF"
    try:
        on_by_default = Version(node.base) >= DEFERRED_DEFAULT_ON
    except InvalidVersion:
        on_by_default = False
    return "on (default)" if on_by_default else "not observable (default off)"


def _checksum_recommended(node: Node) -> bool:
    try:
        return any(k.flag == CHECKSUM_FLAG for k in knobs_for(node.base))
    except HardenedError:  # not a release version: no recommendation
        return False


def judge(nodes: list[Node]) -> list[Finding]:
    """Every unsafe or weak setting, per node and across roles."""
    out: list[Finding] = []
    live = [n for n in nodes if n.info is not None]
    for n in nodes:
        where = f"{n.role} {n.url}"
        if n.info is None:
            out.append(Finding("unsafe", where, f"not reachable ({n.error})", "start it, or leave it out of the deployment"))
            continue
        if not n.hardening.get("hardened"):
            out.append(Finding("unsafe", where, f"sglang {n.get('version')} is not a hardened build",
                               f"install the hardened wheel: pip install --no-deps \"sglang=={n.get('version')}+hardened.N\" "
                               "sglang-hardened (see `sglang-hardened build`)"))
        pool, context = n.get("max_total_num_tokens"), n.get("context_length")
        if isinstance(pool, int) and isinstance(context, int) and pool < context:
            out.append(Finding("unsafe", where, f"KV pool holds {pool} tokens, fewer than the context length {context}",
                               f"give the pool more memory (--mem-fraction-static, --max-total-tokens) "
                               f"or lower --context-length to at most {pool}"))
        if _deferred_release(n) == "OFF":
            out.append(Finding("unsafe", where, "deferred KV release is off: decode gives a failed request's pages "
                               "away while a write can still land in them", f"unset {DEFERRED_ENV}"))
        elif n.role == "decode" and "not observable" in _deferred_release(n):
            out.append(Finding("warn", where, f"deferred KV release is off by default on {n.base} and cannot be read remotely",
                               f"start with `sglang-hardened launch` or set {DEFERRED_ENV}=1"))
        if n.hardening.get("page_tags") is False:
            out.append(Finding("unsafe", where, "H8's page tags are switched off: pages decode reads are not "
                               "checked against their writer (a decode with tags refuses every transfer from a "
                               "prefill without them)", f"unset {PAGE_TAGS.name} on every node (off is for measuring "
                               "H8's cost)"))
        if n.hardening.get("bootstrap_token") is False:
            out.append(Finding("warn", where, "no bootstrap token: anyone who reaches prefill's bootstrap port can "
                               "replace a rank's registration (H14), and read H4's outcomes",
                               f"set {BOOTSTRAP_TOKEN.name} to the same secret on both roles (the recipe's Secret)"))
        if _checksum_recommended(n) and n.get(CHECKSUM_FIELD) is False:
            out.append(Finding("warn", where, "KV checksums are off",
                               f"start both roles with {CHECKSUM_FLAG} (or `sglang-hardened launch`)"))
    out += _across_roles(live)
    return out


def _across_roles(live: list[Node]) -> list[Finding]:
    out = []
    prefill = [n for n in live if n.role == "prefill"]
    decode = [n for n in live if n.role == "decode"]
    for key in (*LAYOUT_FIELDS, "disaggregation_transfer_backend", CHECKSUM_FIELD):
        values = {str(n.get(key)) for n in live}
        if len(values) > 1:
            out.append(Finding("unsafe", "all nodes", f"{key} differs across nodes: {', '.join(sorted(values))}",
                               f"start every prefill and decode node with the same {key}"))
    limits = [n.get("max_req_input_len") for n in prefill]
    prefill_limit = min((v for v in limits if isinstance(v, int)), default=None)
    for n in decode:
        limit = n.get("max_req_input_len")
        if prefill_limit is not None and isinstance(limit, int) and limit > prefill_limit:
            out.append(Finding("unsafe", f"decode {n.url}", f"accepts inputs up to {limit} tokens, a prefill only up to "
                               f"{prefill_limit}", "give both roles the same --context-length and KV pools that hold it"))
    return out


NODE_COLUMNS = ("role", "url", "sglang", "runs on", "hardening", "pool/context", "input limit", "page", "kv dtype",
                "checksum", "deferred release", "backend")


def node_row(n: Node) -> tuple[str, ...]:
    if n.info is None:
        return (n.role, n.url, "unreachable", *["-"] * (len(NODE_COLUMNS) - 3))
    hardening = " ".join(n.hardening.get("hardening_ids", [])) or "unhardened"
    limit = str(n.get("max_req_input_len"))
    if n.bootstrap_limit is not None:
        limit += f" (bootstrap {n.bootstrap_limit})"
    return (n.role, n.url, str(n.get("version")), n.hardening.get("runs_on", "-"), hardening,
            f"{n.get('max_total_num_tokens')}/{n.get('context_length')}", limit, str(n.get("page_size")),
            str(n.get("kv_cache_dtype")), str(n.get(CHECKSUM_FIELD, "n/a")),
            _deferred_release(n) if n.role == "decode" else "-", str(n.get("disaggregation_transfer_backend")))


def preflight(prefill: list[str], decode: list[str], timeout: float = 10.0, bootstrap: bool = True) -> Report:
    nodes = [probe("prefill", u, timeout, bootstrap) for u in prefill] + [probe("decode", u, timeout) for u in decode]
    return Report(nodes, judge(nodes))
