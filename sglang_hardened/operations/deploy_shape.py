"""`deploy check` on the rendered recipe: what it would run, and whether the recipe can run that.

deploy_wiring judges the secrets; this judges the rest of what `kubectl apply -k` would create:
each image pinned (a digest, or a release tag), the model mounted where the servers read it,
servers per role and pods per server (LeaderWorkerSet `size`) as the recipe runs them, and smg's
service discovery finding exactly each role's serving pods with a Role that allows no more than
reading pods. Every rule here stands for a way the rendered recipe starts and then misroutes,
misjudges or fails on its own: a pod added by scaling that smg would never pair, a gate that
judges one pod of a Service at random, a multi-node group whose pods each start a server of
their own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from .deploy_wiring import COMPONENT
from .preflight import Finding

ROLES = ("prefill", "decode")
SERVICE_DISCOVERY = "--service-discovery"
SELECTOR_FLAGS = {"prefill": "--prefill-selector", "decode": "--decode-selector"}
BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"  # smg's default --bootstrap-port-annotation
LWS_LEADER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on a group's leader
# What the LWS controller sets in every pod of a group, and the SGLang flag each must become
LWS_MULTINODE_ARGS = {"--dist-init-addr": "LWS_LEADER_ADDRESS", "--nnodes": "LWS_GROUP_SIZE",
                      "--node-rank": "LWS_WORKER_INDEX"}
LWS_ENV = tuple(LWS_MULTINODE_ARGS.values())
READ_VERBS = {"get", "list", "watch"}
MUTABLE_TAGS = re.compile(r"^(latest|main|master|nightly|dev|edge|stable)$")
_IMAGE = re.compile(r"^(?P<name>[^@]+?)(:(?P<tag>[\w][\w.-]{0,127}))?(@(?P<digest>sha256:[0-9a-f]{64}))?$")


@dataclass(frozen=True)
class Server:
    """One role's servers as one workload runs them: `replicas` servers of `size` pods each."""

    component: str
    workload: str  # kind/name
    replicas: int
    size: int
    leader: dict  # the pod template of the pod that serves HTTP (the only one for size 1)
    worker: dict  # the pod template of every other pod of a group (the leader's, for size 1)
    leader_labels: dict[str, str]  # as the running pods carry them (LWS adds the worker index)
    worker_labels: dict[str, str]


def servers(docs: list[dict]) -> list[Server]:
    """Every server workload of a rendered overlay (LeaderWorkerSet, or a RoleBasedGroup's roles)."""
    out = []
    for doc in docs:
        spec, name = doc.get("spec", {}), f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "LeaderWorkerSet":
            lwt = spec["leaderWorkerTemplate"]
            worker = lwt["workerTemplate"]
            leader = lwt.get("leaderTemplate", worker)
            out.append(Server(worker["metadata"]["labels"][COMPONENT], name, spec.get("replicas", 1),
                              lwt.get("size", 1), leader, worker, {**leader["metadata"]["labels"], LWS_LEADER_LABEL: "0"},
                              {**worker["metadata"]["labels"], LWS_LEADER_LABEL: "1"}))
        elif doc["kind"] == "RoleBasedGroup":
            for role in spec["roles"]:
                pattern = role.get("standalonePattern") or role.get("leaderWorkerPattern") or {}
                template = pattern.get("template", {})
                component = template.get("metadata", {}).get("labels", {}).get(COMPONENT, role["name"])
                labels = template.get("metadata", {}).get("labels", {})
                out.append(Server(component, f"{name} role {role['name']}", role.get("replicas", 1),
                                  pattern.get("size", 1), template, template, labels, labels))
    return out


def _argv(container: dict) -> list[str]:
    return container.get("command", []) + container.get("args", [])


def _flag(argv: list[str], flag: str) -> str | None:
    """The value after `flag` (or in `flag=value`), None if absent."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


def _selector(argv: list[str], flag: str) -> dict[str, str] | None:
    """smg's `--prefill-selector k=v k=v ...` as labels (its parser takes every word up to the next flag)."""
    if flag not in argv:
        return None
    words = argv[argv.index(flag) + 1:]
    words = words[:next((n for n, w in enumerate(words) if w.startswith("--")), len(words))]
    return dict(w.split("=", 1) for w in words if "=" in w)


def _server_container(template: dict) -> dict:
    return next((c for c in template.get("spec", {}).get("containers", []) if c["name"] == "server"), {})


def gateway_deployment(docs: list[dict]) -> tuple[dict, dict] | None:
    """The gateway Deployment and its pod template."""
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["spec"]["template"]["metadata"]["labels"].get(COMPONENT) == "gateway":
            return doc, doc["spec"]["template"]
    return None


def judge_images(docs: list[dict], where: str) -> list[Finding]:
    """Every image a pod would pull: by digest, or by a tag that names a release."""
    out, seen = [], set()
    for doc in docs:
        for template in _templates(doc):
            for c in template["spec"].get("containers", []) + template["spec"].get("initContainers", []):
                image = c.get("image", "")
                if image in seen:
                    continue
                seen.add(image)
                parts = _IMAGE.match(image)
                if parts is None or not (parts["tag"] or parts["digest"]):
                    out.append(Finding("unsafe", f"{where} {c['name']}", f"image {image!r} names no tag or digest: "
                                       "each node pulls whatever :latest is that day",
                                       "name a release tag, or better a digest (@sha256:...)"))
                elif not parts["digest"] and MUTABLE_TAGS.match(parts["tag"]):
                    out.append(Finding("warn", f"{where} {c['name']}", f"image {image} is a moving tag: two nodes "
                                       "(or one pod's restart) can run different builds",
                                       "name a release tag, or a digest (@sha256:...)"))
    return out


def _templates(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    if doc["kind"] == "Deployment":
        return [spec["template"]]
    if doc["kind"] == "CronJob":
        return [spec["jobTemplate"]["spec"]["template"]]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [lwt["workerTemplate"], *([lwt["leaderTemplate"]] if "leaderTemplate" in lwt else [])]
    if doc["kind"] == "RoleBasedGroup":
        return [(r.get("standalonePattern") or r.get("leaderWorkerPattern") or {}).get("template", {"spec": {}})
                for r in spec["roles"]]
    return []


def judge_model(found: list[Server], model_path: str, where: str) -> list[Finding]:
    """Each server pod mounts a volume at or above the model path its `--model-path` reads."""
    out = []
    for server in found:
        for template in {id(t): t for t in (server.leader, server.worker)}.values():
            spec, container = template.get("spec", {}), _server_container(template)
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            mounts = [m for m in container.get("volumeMounts", [])
                      if PurePosixPath(model_path).is_relative_to(m["mountPath"]) and m["name"] in volumes]
            if not mounts:
                out.append(Finding("unsafe", f"{where} {server.component}", f"no volume is mounted at {model_path} "
                                   f"(MODEL_PATH), which --model-path reads: the server stops at start-up",
                                   "mount the model's volume at or above MODEL_PATH (base/server-common.yaml "
                                   "mounts the PVC sglang-hardened-model at /models)"))
    return out


def judge_servers(docs: list[dict], where: str) -> list[Finding]:
    """Servers per role and pods per server, against what smg and the gate can route and judge."""
    found = servers(docs)
    out = []
    for role in ROLES:
        mine = [s for s in found if s.component == role]
        if not mine:
            out.append(Finding("unsafe", f"{where} {role}", f"no {role} server in the rendered overlay",
                               "render the recipe's own overlay, or one built on ../base"))
        for server in mine:
            if server.replicas < 1:
                out.append(Finding("unsafe", f"{where} {server.workload}", f"replicas {server.replicas}: no {role} "
                                   "server runs, and every request fails", "run at least one"))
            if server.size > 1:
                out += _multinode(server, where)
    gateway = gateway_deployment(docs)
    if gateway is None:
        return out + [Finding("unsafe", f"{where} gateway", "no gateway Deployment in the rendered overlay",
                              "render the recipe's own overlay, or one built on ../base")]
    deployment, template = gateway
    smg = next((c for c in template["spec"]["containers"] if c["name"] == "gateway"), {})
    if deployment["spec"].get("replicas", 1) < 2:
        out.append(Finding("warn", f"{where} gateway", f"{deployment['spec'].get('replicas', 1)} gateway replica: "
                           "a node drain or a gateway restart stops the service", "run two (base/gateway.yaml)"))
    out += _discovery(found, _argv(smg), where)
    out += _gate(found, template, where)
    return out


def _multinode(server: Server, where: str) -> list[Finding]:
    """A group of `size` pods is one server only if each pod learns its place from LWS."""
    out, at = [], f"{where} {server.workload}"
    if not server.workload.startswith("LeaderWorkerSet/"):
        return [Finding("unsafe", at, f"a {server.size}-pod server in a RoleBasedGroup: the recipe runs multi-node "
                        "servers as LeaderWorkerSets only", "use the lws-multinode overlay")]
    argv = _argv(_server_container(server.worker))
    for flag, var in LWS_MULTINODE_ARGS.items():
        value = _flag(argv, flag)
        if value is None or f"$({var})" not in value:
            out.append(Finding("unsafe", at, f"size {server.size} but {flag} is not taken from {var}: each pod of "
                               "the group starts a server of its own", "build on the lws-multinode overlay"))
    if any(k.endswith("Probe") and "httpGet" in v for k, v in _server_container(server.worker).items()):
        out.append(Finding("unsafe", at, "the group's workers have HTTP probes, but only the leader serves HTTP: "
                           "they never become Ready", "probe the leader only (lws-multinode)"))
    return out


def _discovery(found: list[Server], argv: list[str], where: str) -> list[Finding]:
    """smg finds each role's serving pods, and only those, by its selectors."""
    at = f"{where} gateway"
    several = [s for s in found if s.replicas > 1 or s.size > 1]
    if SERVICE_DISCOVERY not in argv:
        if several:
            return [Finding("unsafe", at, f"{several[0].workload} runs {several[0].replicas} servers but smg is "
                            "given static URLs: it pairs through a Service, one pod at random per connection",
                            "start smg with --service-discovery and a selector per role (base/gateway.yaml)")]
        return []
    out = []
    if _flag(argv, "--service-discovery-namespace") is None:
        out.append(Finding("unsafe", at, "smg watches every namespace (no --service-discovery-namespace): it "
                           "pairs any pod so labelled anywhere, and its Role cannot allow that",
                           "pass --service-discovery-namespace $(POD_NAMESPACE)"))
    for role in ROLES:
        selector = _selector(argv, SELECTOR_FLAGS[role]) or {}
        other = "decode" if role == "prefill" else "prefill"
        for server in (s for s in found if s.component in ROLES):
            picks = selector and all(server.leader_labels.get(k) == v for k, v in selector.items())
            picks_worker = (selector and server.size > 1
                            and all(server.worker_labels.get(k) == v for k, v in selector.items()))
            if server.component == role and not picks:
                out.append(Finding("unsafe", at, f"smg's {SELECTOR_FLAGS[role]} {selector or '(none)'} does not select "
                                   f"{server.workload}'s pods: smg never routes to them", "select the role's labels"))
            elif server.component == other and picks:
                out.append(Finding("unsafe", at, f"smg's {SELECTOR_FLAGS[role]} also selects {server.workload}'s "
                                   f"{other} pods: it would send {role} work to them", "select the role's labels"))
            elif server.component == role and picks_worker:
                out.append(Finding("unsafe", at, f"smg's {SELECTOR_FLAGS[role]} selects the workers of "
                                   f"{server.workload}'s groups, which serve no HTTP",
                                   f"add {LWS_LEADER_LABEL}=0 to it (lws-multinode)"))
    port = _flag(argv, "--service-discovery-port")
    for server in found:
        container = _server_container(server.leader)
        served = _flag(_argv(container), "--port")
        if port != served:
            out.append(Finding("unsafe", at, f"smg connects to discovered pods on port {port or 'its default'}, "
                               f"{server.workload} serves on {served}", "pass --service-discovery-port "
                               "with the servers' --port"))
        if server.component == "prefill":
            bootstrap = _flag(_argv(container), "--disaggregation-bootstrap-port")
            annotated = server.leader.get("metadata", {}).get("annotations", {}).get(BOOTSTRAP_ANNOTATION)
            if annotated != bootstrap:
                out.append(Finding("unsafe", f"{where} {server.workload}", f"the pods' {BOOTSTRAP_ANNOTATION} "
                                   f"annotation is {annotated!r}, their bootstrap port {bootstrap}: smg tells decode "
                                   "to bootstrap elsewhere, and every request fails",
                                   "annotate the pods with their --disaggregation-bootstrap-port"))
    return out


def _gate(found: list[Server], template: dict, where: str) -> list[Finding]:
    """The gate judges every server smg routes to, not one pod behind a Service."""
    gate = next((c for c in template["spec"]["containers"] if c["name"] == "preflight-gate"), None)
    probe = (gate or {}).get("readinessProbe", {}).get("exec", {}).get("command", [])
    if "preflight" not in probe:
        return [Finding("unsafe", f"{where} gateway", "the gateway has no preflight gate: an unsafe server "
                        "joining the pool is routed to", "keep base/gateway.yaml's preflight-gate container")]
    several = [s for s in found if s.replicas > 1]
    if "--gateway" not in probe and several:
        return [Finding("unsafe", f"{where} gateway", f"{several[0].workload} runs {several[0].replicas} servers "
                        "but the gate judges the URLs it is given: through a Service, one pod at random",
                        "run the gate as preflight --gateway http://127.0.0.1:8000 (base/gateway.yaml)")]
    return []


def judge_rbac(docs: list[dict], where: str) -> list[Finding]:
    """The gateway's ServiceAccount may read pods in its namespace, and do nothing else."""
    gateway = gateway_deployment(docs)
    account = gateway[1]["spec"].get("serviceAccountName") if gateway else None
    if account is None:
        return []
    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("Role", "ClusterRole")}
    granted: list[dict] = []
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if any(s.get("kind") == "ServiceAccount" and s.get("name") == account for s in binding.get("subjects", [])):
            if binding["kind"] == "ClusterRoleBinding" or binding["roleRef"]["kind"] == "ClusterRole":
                return [Finding("unsafe", f"{where} {binding['kind']}/{binding['metadata']['name']}",
                                f"the gateway's ServiceAccount {account} holds a ClusterRole: its token reads (or "
                                "writes) beyond this namespace", "bind a Role in this namespace (base/rbac.yaml)")]
            granted += roles.get(("Role", binding["roleRef"]["name"]), {}).get("rules", [])
    out = []
    for rule in granted:
        wider = (set(rule.get("verbs", [])) - READ_VERBS) | (set(rule.get("resources", [])) - {"pods"}) \
            | (set(rule.get("apiGroups", [])) - {""})
        if wider:
            what = f"{', '.join(rule.get('verbs', []))} on {', '.join(rule.get('resources', []))}"
            out.append(Finding("unsafe", f"{where} gateway", f"the gateway's ServiceAccount {account} is allowed "
                               f"{what}: whoever takes smg's container holds that too",
                               "grant get, list and watch on pods only (base/rbac.yaml)"))
    if not any({"list", "watch"} <= set(r.get("verbs", [])) and "pods" in r.get("resources", []) for r in granted):
        out.append(Finding("unsafe", f"{where} gateway", f"the gateway's ServiceAccount {account} may not list and "
                           "watch pods: smg finds no server, and the gate keeps the gateway out of service",
                           "bind base/rbac.yaml's Role to it"))
    return out


def volumes_read(docs: list[dict]) -> list[str]:
    """Every PersistentVolumeClaim the rendered pods mount: what the operator must create."""
    return sorted({v["persistentVolumeClaim"]["claimName"] for doc in docs for t in _templates(doc)
                   for v in t.get("spec", {}).get("volumes", []) if "persistentVolumeClaim" in v})
