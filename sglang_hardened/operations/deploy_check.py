"""`deploy check`: preflight's rules on the Kubernetes recipe's parameter file, before anything is applied.

The recipe (`deploy/kubernetes/`) takes every value an operator chooses from one env file. This
check turns that file into the two servers preflight would see once they run through `launch`,
and judges them with preflight's own rules (`preflight.judge`), so a pool smaller than the
context, unequal input limits or a layout that differs between roles is refused before a pod
is scheduled. `--max-total-tokens` is an upper bound: a GPU with less memory makes a smaller
pool, which H7 at start-up and the gateway's preflight gate judge on the live servers.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..common.errors import HardenedError
from ..common.knobs import KNOBS, Knob
from ..runtime.policy import knob_value
from .preflight import Finding, Node, judge

# Every key the file must hold, and what it is; any other key but the policy's knobs is a typo, refused.
PARAMS = {
    "IMAGE": "the hardened image, tagged <release>-hardened.<n> as scripts/build-image tags it",
    "TOOL_IMAGE": "the slim tool image of the same release (the gate and the canary), tagged as IMAGE is",
    "GATEWAY_IMAGE": "an image with the SGLang Model Gateway (`smg`) on its PATH",
    "MODEL_PATH": "the model directory inside the servers' pods (both roles load the same one)",
    "CONTEXT_LENGTH": "both roles' --context-length",
    "PREFILL_MAX_TOTAL_TOKENS": "prefill's --max-total-tokens: its KV pool, at least the context",
    "DECODE_MAX_TOTAL_TOKENS": "decode's --max-total-tokens: its KV pool, at least the context",
    "PAGE_SIZE": "both roles' --page-size",
    "KV_CACHE_DTYPE": "both roles' --kv-cache-dtype",
    "TRANSFER_BACKEND": "both roles' --disaggregation-transfer-backend (mooncake or nixl)",
    "KUBERNETES_API_CIDR": "the API server's addresses the gateway may reach (smg's service discovery)",
}
INTEGERS = ("CONTEXT_LENGTH", "PREFILL_MAX_TOTAL_TOKENS", "DECODE_MAX_TOTAL_TOKENS", "PAGE_SIZE")
TRANSFER_BACKENDS = ("mooncake", "nixl")
# wider than this per IP version, the gateway's one way out of the namespace reaches more than an API server's
API_CIDR_NARROW = {4: 24, 6: 64}
UNSAFE_VALUE = re.compile(r"^\s|\s$|[#'\"]")  # kustomize's env files take the rest of the line as the value
# scripts/build-image's tag (image/build.py default_tag), with an optional registry and digest
HARDENED_TAG = re.compile(r":(?P<release>(?P<base>\d+\.\d+\.\d+)-hardened\.\d+)(@sha256:[0-9a-f]{64})?$")


@cache
def policy_knobs() -> dict[str, Knob]:
    """The hardening's knobs a server reads (common/knobs.py, the one registry): an operator may set
    any of them here, and envFrom hands them to both roles' servers. The bootstrap token is not
    one: a secret comes from the Secret, never a ConfigMap."""
    return {k.name: k for k in KNOBS if k.role == "server" and k.type != "secret"}


@dataclass(frozen=True)
class Params:
    path: Path
    values: dict[str, str]

    def int(self, key: str) -> int:
        return int(self.values[key])


def read_params(path: Path) -> Params:
    """The env file as kustomize's configMapGenerator reads it: KEY=VALUE lines, # comments."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise HardenedError(f"cannot read the parameter file {path}: {exc.strerror}") from None
    values: dict[str, str] = {}
    where: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        line = line.lstrip("\ufeff \t")  # kustomize drops a BOM and leading blanks, and keeps the rest
        if not line.strip() or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or key not in PARAMS.keys() | policy_knobs().keys():  # the value is not shown: it may be a secret
            raise HardenedError(f"{path}:{number}: {key!r} is not one of the recipe's parameters ({', '.join(PARAMS)}) "
                                "nor a server knob of the hardening (`sglang-hardened policy knobs`); a secret goes in the "
                                "recipe's Secret, not here (docs/kubernetes.md)")
        if key in values:
            raise HardenedError(f"{path}:{number}: {key} is set twice")
        if UNSAFE_VALUE.search(value):
            raise HardenedError(f"{path}:{number}: {key}={value!r}: the ConfigMap would hold it as written (spaces, "
                                "quotes or a # comment included); write the bare value")
        if key in policy_knobs():
            try:
                knob_value(policy_knobs()[key], {key: value})
            except ValueError as exc:
                raise HardenedError(f"{path}:{number}: {exc}") from None
        values[key], where[key] = value, f"{path}:{number}"
    missing = [k for k in PARAMS if not values.get(k)]
    if missing:
        raise HardenedError(f"{path}: no value for {', '.join(missing)}")
    for key in INTEGERS:
        if not re.fullmatch(r"[0-9]+", values[key]) or int(values[key]) <= 0:
            raise HardenedError(f"{where[key]}: {key}={values[key]!r} is not a positive whole number")
    try:
        ipaddress.ip_network(values["KUBERNETES_API_CIDR"])
    except ValueError as exc:
        raise HardenedError(f"{where['KUBERNETES_API_CIDR']}: KUBERNETES_API_CIDR: {exc}") from None
    return Params(path, values)


def _server(params: Params, role: str, base: str) -> Node:
    """The server `launch` starts from these values, as preflight reads it from /server_info."""
    page, context = params.int("PAGE_SIZE"), params.int("CONTEXT_LENGTH")
    pool = params.int(f"{role.upper()}_MAX_TOTAL_TOKENS") // page * page  # SGLang sizes the pool in whole pages
    info = {
        "version": base,
        # every server starts through `launch`, whose policy turns deferred release (H5) on
        "hardening": {"hardened": True, "base": base, "deferred_decode_kv_release": True},
        "max_total_num_tokens": pool,
        "context_length": context,
        "max_req_input_len": min(context - 1, pool - 1) - 5,  # SGLang's tp_worker: max_req_len - 5
        "page_size": page,
        "kv_cache_dtype": params.values["KV_CACHE_DTYPE"],
        "disaggregation_transfer_backend": params.values["TRANSFER_BACKEND"],
    }
    return Node(role, f"{params.path.name}", info)


def check(params: Params) -> list[Finding]:
    """Preflight's findings on the servers these values start, plus the file's own."""
    out: list[Finding] = []
    image = params.values["IMAGE"]
    tag = HARDENED_TAG.search(image)
    if tag is None:
        out.append(Finding("unsafe", "IMAGE", f"{image} is not tagged as a hardened build (<release>-hardened.<n>)",
                           "build it with `scripts/build-image --base <release>`, push it, and set IMAGE to that tag"))
    tool = params.values["TOOL_IMAGE"]
    tool_tag = HARDENED_TAG.search(tool)
    if tag and (tool_tag is None or tool_tag.group("release") != tag.group("release")):
        # the gate judges the servers with its own release's rules: another release's may pass what this one refuses
        out.append(Finding("unsafe", "TOOL_IMAGE", f"{tool} is not the tool image of {image}'s release "
                           f"({tag.group('release')})", "build it with `scripts/build-image --tool` beside the "
                           "servers' image, push it, and set TOOL_IMAGE to the same tag"))
    if params.values["TRANSFER_BACKEND"] not in TRANSFER_BACKENDS:
        out.append(Finding("unsafe", "TRANSFER_BACKEND", f"{params.values['TRANSFER_BACKEND']!r} is not a backend "
                           "the hardening covers", f"use one of {', '.join(TRANSFER_BACKENDS)}"))
    for key in params.values.keys() & policy_knobs().keys():
        knob = policy_knobs()[key]
        if knob.weakens and knob_value(knob, params.values) != knob_value(knob, {}):
            out.append(Finding("unsafe", key, f"{key}={params.values[key]} gives up part of {knob.id}: {knob.doc}",
                               "leave it unset in the recipe (it is for measuring, or a deliberate exception)"))
    api = ipaddress.ip_network(params.values["KUBERNETES_API_CIDR"])
    if api.prefixlen == 0:
        out.append(Finding("unsafe", "KUBERNETES_API_CIDR", "the gateway may reach every address on the API "
                           "server's ports, the internet's included", "name the API server's addresses"))
    elif api.prefixlen < API_CIDR_NARROW[api.version]:
        out.append(Finding("warn", "KUBERNETES_API_CIDR", f"the gateway may reach {api.num_addresses} addresses on "
                           "the API server's ports", "name the API server's addresses (a /32 each where you can)"))
    base = tag.group("base") if tag else "unknown"
    out += judge([_server(params, "prefill", base), _server(params, "decode", base)])
    return out

