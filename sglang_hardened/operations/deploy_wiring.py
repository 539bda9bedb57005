"""`deploy check` on the rendered recipe: the secrets its defences need are wired from a Secret.

Two defences of the recipe hold only with a secret: prefill's bootstrap server takes
registrations (H14) and serves H4's outcomes only to a sender of BOOTSTRAP_TOKEN.name, and smg changes its
worker pool (`DELETE /workers/<id>`, `POST /workers`) only for a holder of a control-plane key.
Neither may come from params.env (a ConfigMap, readable with the namespace's config and kept in
git) nor be written into a manifest: each must be an `env` entry whose value is a required
`secretKeyRef`, which the kubelet fills in at start, and refuses to start the pod without. Each
overlay is rendered as `kubectl apply -k` would render it and judged here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from ..common.knobs import BOOTSTRAP_TOKEN
from ..common.errors import HardenedError
from .preflight import Finding

OVERLAYS = ("lws", "lws-multinode", "rbg")  # the recipe's own, next to its params/ folder
COMPONENT = "app.kubernetes.io/component"
SMG_KEYS_FLAG = "--control-plane-api-keys"  # smg's admin keys, each 'id:name:role:key'
# smg's flags that carry a credential: each value must end in a $(VAR) filled from a Secret
SMG_SECRET_FLAGS = (SMG_KEYS_FLAG, "--api-key", "--tenant-api-key")
_REFERENCE = re.compile(r"\$\((\w+)\)$")


def render(kustomization: Path) -> list[dict]:
    """`kubectl kustomize` of one kustomization folder, as its documents."""
    import yaml

    if shutil.which("kubectl") is None:
        raise HardenedError("kubectl is not on PATH: the recipe is rendered with `kubectl kustomize`")
    out = subprocess.run(["kubectl", "kustomize", str(kustomization)], capture_output=True, text=True, check=False)
    if out.returncode:
        raise HardenedError(f"kubectl kustomize {kustomization} failed: {out.stderr.strip()}")
    return list(yaml.safe_load_all(out.stdout))


def overlays_of(params_file: Path, given: list[Path]) -> list[Path]:
    """The overlays to judge: those given, else the recipe's own beside the parameter file's folder."""
    if given:
        return given
    recipe = params_file.resolve().parent.parent
    found = [recipe / name for name in OVERLAYS if (recipe / name / "kustomization.yaml").is_file()]
    if not found:
        raise HardenedError(f"{params_file} is not in a copy of the recipe (no {' or '.join(OVERLAYS)} folder in "
                            f"{recipe}): name the kustomizations to judge with --overlay")
    return found


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    """Each workload's pod template by the component it runs (prefill, decode, gateway, canary);
    a multi-node group's workers run its leader's template less the probes (deploy_shape judges them)."""
    out = {}
    for doc in docs:
        spec = doc.get("spec", {})
        if doc["kind"] == "Deployment":
            templates = [spec["template"]]
        elif doc["kind"] == "CronJob":
            templates = [spec["jobTemplate"]["spec"]["template"]]
        elif doc["kind"] == "LeaderWorkerSet":  # a multi-node group's leader: the pod that serves
            lwt = spec["leaderWorkerTemplate"]
            templates = [lwt.get("leaderTemplate", lwt["workerTemplate"])]
        elif doc["kind"] == "RoleBasedGroup":
            templates = [role["standalonePattern"]["template"] for role in spec["roles"]]
        else:
            templates = []
        for template in templates:
            out[template["metadata"]["labels"][COMPONENT]] = template
    return out


def _container(templates: dict[str, dict], component: str, name: str) -> dict | None:
    spec = templates.get(component, {}).get("spec", {})
    return next((c for c in spec.get("containers", []) if c["name"] == name), None)


def _secret_ref(container: dict, var: str) -> tuple[dict | None, str]:
    """The required secretKeyRef `var` is set from, or None and what is wrong instead."""
    entry = next((e for e in container.get("env", []) if e["name"] == var), None)
    if entry is None:
        return None, "not set"
    if "value" in entry:
        return None, "written into the manifest"
    ref = entry.get("valueFrom", {}).get("secretKeyRef")
    if ref is None:
        return None, f"taken from {', '.join(entry.get('valueFrom', {})) or 'nothing'}, not a Secret"
    if ref.get("optional"):
        return None, f"optional (Secret {ref['name']}): the pod starts without it"
    return ref, ""


def _flag_values(argv: list[str], flag: str) -> list[str]:
    """Every value smg's parser gives `flag`: `--flag=v`, `--flag v`, and for the control-plane
    keys (nargs '*') every argument up to the next flag."""
    values = []
    for i, arg in enumerate(argv):
        if arg.startswith(f"{flag}="):
            values.append(arg.split("=", 1)[1])
        elif arg == flag:
            following = argv[i + 1:]
            taken = next((n for n, a in enumerate(following) if a.startswith("--")), len(following))
            values += following[:taken] if flag == SMG_KEYS_FLAG else following[:1]
    return values


def _bootstrap_token(templates: dict[str, dict], where: str) -> list[Finding]:
    out, refs = [], {}
    for role in ("prefill", "decode"):
        server = _container(templates, role, "server")
        if server is None:
            out.append(Finding("unsafe", f"{where} {role}", "no server container in the rendered overlay",
                               "render the recipe's own overlay, or one built on ../base"))
            continue
        ref, problem = _secret_ref(server, BOOTSTRAP_TOKEN.name)
        if ref is None:
            out.append(Finding("unsafe", f"{where} {role}", f"{BOOTSTRAP_TOKEN.name} is {problem}: anyone who reaches prefill's "
                               "bootstrap port can replace a rank's registration and read H4's outcomes",
                               "take it from the Secret with a required secretKeyRef, as base/server-common.yaml does"))
        else:
            refs[role] = (ref["name"], ref["key"])
    if len(set(refs.values())) > 1:
        out.append(Finding("unsafe", where, f"prefill and decode take {BOOTSTRAP_TOKEN.name} from different Secret keys "
                           f"({', '.join(f'{r}: {n}/{k}' for r, (n, k) in refs.items())}): prefill refuses "
                           "decode's reads", "give both roles the same Secret key"))
    return out


def _gateway_keys(templates: dict[str, dict], where: str) -> list[Finding]:
    gateway = _container(templates, "gateway", "gateway")
    if gateway is None:
        return [Finding("unsafe", f"{where} gateway", "no gateway container in the rendered overlay",
                        "render the recipe's own overlay, or one built on ../base")]
    argv = gateway.get("command", []) + gateway.get("args", [])
    out = []
    if not _flag_values(argv, SMG_KEYS_FLAG):
        out.append(Finding("unsafe", f"{where} gateway", f"smg starts without {SMG_KEYS_FLAG}: whoever reaches its "
                           "port removes workers (DELETE /workers/<id>) or adds its own (POST /workers)",
                           f"pass {SMG_KEYS_FLAG} 'id:name:admin:$(VAR)' with VAR from the Secret, as "
                           "base/gateway.yaml does"))
    for flag in SMG_SECRET_FLAGS:
        for value in _flag_values(argv, flag):
            reference = _REFERENCE.search(value)
            ref, problem = (_secret_ref(gateway, reference.group(1)) if reference
                            else (None, "written into the manifest"))
            if ref is None:
                out.append(Finding("unsafe", f"{where} gateway", f"smg's {flag} credential is {problem}",
                                   "end the value in $(VAR), with VAR taken from the Secret by a required "
                                   "secretKeyRef"))
    return out


def judge_wiring(docs: list[dict], where: str) -> list[Finding]:
    """Findings on one rendered overlay: the bootstrap token and smg's credentials each from a Secret."""
    templates = pod_templates(docs)
    return _bootstrap_token(templates, where) + _gateway_keys(templates, where)


def secrets_read(docs: list[dict]) -> list[str]:
    """`secret/key` of every Secret value the rendered pods read: what the operator must create."""
    return sorted({f"{e['valueFrom']['secretKeyRef']['name']}/{e['valueFrom']['secretKeyRef']['key']}"
                   for template in pod_templates(docs).values() for c in template["spec"]["containers"]
                   for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})})
