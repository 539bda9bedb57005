"""The Kubernetes recipe (deploy/kubernetes/) renders, validates and is safe as written.

No cluster is reachable here: every overlay is rendered with the real `kubectl kustomize`,
built-in kinds are validated against Kubernetes' own schemas (kubernetes-validate, pinned
version below) and LeaderWorkerSet and RoleBasedGroup against their CRDs' schemas vendored in
tests/kubernetes/crds/ (SOURCES.toml names each file's origin and hash). The network policies
are evaluated rule by rule, in and out, for who reaches which port; every pod's security context
is held to the Pod Security Standards' checks; the gate's own probe is run against loopback
stand-ins; `deploy check` is run on the shipped recipe and on unsafe parameters and wiring.
"""

from __future__ import annotations

import copy
import os
import functools
import hashlib
import ipaddress
import json
import re
import shutil
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from sglang_hardened.common.knobs import BOOTSTRAP_TOKEN
from sglang_hardened.cli import main
from sglang_hardened.common.paths import patches_dir
from sglang_hardened.image.build import default_tag
from sglang_hardened.operations.deploy_shape import LWS_ENV
from sglang_hardened.operations.deploy_wiring import OVERLAYS, SMG_KEYS_FLAG, pod_templates
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.pipeline.stamp import hardened_version
from sglang_hardened.sandbox.recipe import RECIPE, render
from tests.harness import REPO

PARAMS = RECIPE / "params" / "params.env"
CRDS = REPO / "tests" / "kubernetes" / "crds"
KUBERNETES = "1.32.0"  # the schemas built-in kinds are validated against (kubectl here is 1.32)
WORKLOADS = {"LeaderWorkerSet": "spec.leaderWorkerTemplate.workerTemplate",
             "RoleBasedGroup": "spec.roles[].standalonePattern.template"}


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the served version's openAPIV3Schema, from the hash-checked vendored CRDs."""
    sources = tomllib.loads((CRDS / "SOURCES.toml").read_text())
    schemas = {}
    for name, source in sources.items():
        data = (CRDS / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == source["sha256"], f"{name} is not {source['repository']}'s file"
        crd = yaml.load(data, Loader=yaml.CSafeLoader)  # 4 MB: the C loader
        for version in crd["spec"]["versions"]:
            if version["served"]:
                api = f"{crd['spec']['group']}/{version['name']}"
                schemas[(api, crd["spec"]["names"]["kind"])] = version["schema"]["openAPIV3Schema"]
    return schemas


def validate(doc: dict, schemas: dict[tuple[str, str], dict]) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key in schemas:
        jsonschema.validate(doc, schemas[key])
    else:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_every_overlay_validates_and_the_validators_bite(rendered):
    overlay, docs = rendered
    schemas = crd_schemas()
    kinds = {d["kind"] for d in docs}
    assert {"RoleBasedGroup" if overlay == "rbg" else "LeaderWorkerSet"} <= kinds
    assert "PodTemplate" not in kinds, "the PodTemplates are copied into the workloads, not applied"
    for doc in docs:
        validate(doc, schemas)
    # a typo in a built-in kind and a wrong type in the custom resource are both refused
    deployment = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    deployment["spec"]["replica"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, schemas)
    workload = copy.deepcopy(next(d for d in docs if d["kind"] in WORKLOADS))
    (workload["spec"]["roles"][0] if workload["kind"] == "RoleBasedGroup" else workload["spec"])["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        validate(workload, schemas)


def test_every_value_comes_from_the_parameter_file(rendered):
    _, docs = rendered
    params = dict(line.split("=", 1) for line in PARAMS.read_text().splitlines() if line and not line.startswith("#"))
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert config["data"] == params
    assert "Secret" not in {d["kind"] for d in docs}, "the recipe ships no secret value: the operator makes the Secret"
    templates = pod_templates(docs)
    assert set(templates) == {"prefill", "decode", "gateway", "canary"}
    for component, template in templates.items():
        for container in template["spec"]["containers"]:
            assert container["image"] in (params["IMAGE"], params["TOOL_IMAGE"], params["GATEWAY_IMAGE"]), \
                (component, container["image"])
            refs = set(re.findall(r"\$\((\w+)\)", " ".join(container.get("command", []) + container.get("args", []))))
            given = {e["name"] for e in container.get("env", [])} | set(LWS_ENV)  # LWS sets these in every pod
            if any(e["configMapRef"]["name"] == config["metadata"]["name"] for e in container.get("envFrom", [])):
                given |= set(params)
            assert refs <= given, f"{component}/{container['name']} reads {refs - given}, which nothing sets"
    for role in ("prefill", "decode"):
        server = templates[role]["spec"]["containers"][0]
        assert server["command"] == ["sglang-hardened", "launch", "--"], "every server starts through launch"
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(server)
        assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert any(v["mountPath"] == "/dev/shm" for v in server["volumeMounts"])
    gate = next(c for c in templates["gateway"]["spec"]["containers"] if c["name"] == "preflight-gate")
    assert gate["readinessProbe"]["exec"]["command"][:2] == ["sglang-hardened", "preflight"]
    assert "--gateway" in gate["readinessProbe"]["exec"]["command"], "the gate judges every server in smg's pool"


def _selected(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _admits(policies: list[dict], pod: dict, peer: dict, port: int, protocol: str, direction: str) -> bool:
    """Whether the policies selecting `pod` let `peer` in (Ingress) or let `pod` out to `peer`
    (Egress) on `port`: a peer's podSelector alone means the recipe's namespace; with a
    namespaceSelector, pods so labelled in the namespaces it selects. No policy of that
    direction selecting the pod: everything passes."""
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    applying = [p for p in policies if pod["namespace"] == "recipe"
                and _selected(p["spec"]["podSelector"], pod["labels"])
                and direction in p["spec"].get("policyTypes", ["Ingress"])]
    if not applying:
        return True

    def peer_matches(selector: dict) -> bool:
        if "ipBlock" in selector:  # an address outside the pod network (the API server, the internet)
            block = selector["ipBlock"]
            return "ip" in peer and ipaddress.ip_address(peer["ip"]) in ipaddress.ip_network(block["cidr"]) \
                and not any(ipaddress.ip_address(peer["ip"]) in ipaddress.ip_network(c) for c in block.get("except", []))
        in_namespace = (_selected(selector["namespaceSelector"], peer["namespace_labels"])
                        if "namespaceSelector" in selector else peer["namespace"] == "recipe")
        return in_namespace and _selected(selector.get("podSelector", {}), peer["labels"])

    for policy in applying:
        for rule in policy["spec"].get(rules_key, []):
            peers = rule.get(peers_key, [])
            by_peer = any(map(peer_matches, peers)) if peers else True
            ports = rule.get("ports")
            by_port = not ports or any(p.get("protocol", "TCP") == protocol
                                       and p["port"] <= port <= p.get("endPort", p["port"]) for p in ports)
            if by_peer and by_port:
                return True
    return False


def reaches(policies: list[dict], source: dict, target: dict, port: int, protocol: str = "TCP") -> bool:
    """A connection passes both the target's ingress and the source's egress policies."""
    return (_admits(policies, target, source, port, protocol, "Ingress")
            and _admits(policies, source, target, port, protocol, "Egress"))


def pod(labels: dict, namespace: str = "recipe") -> dict:
    return {"labels": labels, "namespace": namespace, "namespace_labels": {"kubernetes.io/metadata.name": namespace}}


BOOTSTRAP, HTTP, TRANSFER = 8998, 30000, 17000  # TRANSFER: any port a transfer engine picks at start
API_SERVER = re.search(r"^KUBERNETES_API_CIDR=(\S+)/32$", PARAMS.read_text(), re.M).group(1)  # the shipped address


@pytest.fixture(scope="module", params=OVERLAYS)
def network(request) -> tuple[list[dict], dict[str, dict]]:
    """The overlay's policies, and the pods that meet them: the recipe's own (labelled as rendered)
    and those around it."""
    docs = render(request.param)
    pods = {component: pod(template["metadata"]["labels"]) for component, template in pod_templates(docs).items()}
    part_of = {"app.kubernetes.io/part-of": "sglang-hardened"}
    pods |= {
        "tenant": pod({"app": "tenant-app"}),  # another app in the recipe's namespace
        "tenant elsewhere": pod({"app": "tenant-app"}, "other"),
        "another part-of pod": pod({**part_of, "app.kubernetes.io/component": "debug"}),  # reached decode before
        "prometheus": pod({"app.kubernetes.io/name": "prometheus"}, "monitoring"),
        "monitoring's other pod": pod({"app": "grafana"}, "monitoring"),
        "kube-dns": pod({"k8s-app": "kube-dns"}, "kube-system"),
        "the internet": {"labels": {}, "namespace": None, "namespace_labels": {}, "ip": "203.0.113.5"},
        "kube-apiserver": {"labels": {}, "namespace": None, "namespace_labels": {}, "ip": API_SERVER},
    }
    return [d for d in docs if d["kind"] == "NetworkPolicy"], pods


# (source, target, port): every way in the recipe needs, and nothing wider (docs/security.md,
# "Who reaches what in the recipe", and networkpolicy.yaml's comment say the same)
OPEN = [
    ("decode", "prefill", BOOTSTRAP), ("decode", "prefill", TRANSFER),
    ("decode", "prefill", HTTP),  # 0.5.23's decode POSTs /generate to recompute a retracted request
    ("prefill", "prefill", BOOTSTRAP), ("prefill", "prefill", TRANSFER),  # a multi-node group's ranks
    ("prefill", "decode", TRANSFER), ("decode", "decode", TRANSFER),
    ("gateway", "prefill", HTTP), ("gateway", "decode", HTTP),
    ("prometheus", "prefill", HTTP), ("prometheus", "decode", HTTP), ("prometheus", "gateway", 29000),
    ("tenant", "gateway", 8000), ("tenant elsewhere", "gateway", 8000), ("canary", "gateway", 8000),
    ("canary", "prefill", HTTP),  # SGLang's /tokenize sizes the canary's prompts
    ("gateway", "kube-apiserver", 443), ("gateway", "kube-apiserver", 6443),  # smg's service discovery
]
SHUT = [
    ("gateway", "prefill", BOOTSTRAP), ("gateway", "prefill", TRANSFER), ("gateway", "decode", TRANSFER),
    ("prefill", "prefill", HTTP), ("prefill", "decode", HTTP), ("decode", "decode", HTTP),
    ("prefill", "gateway", 8000), ("decode", "gateway", 8000),
    ("prometheus", "prefill", BOOTSTRAP), ("prometheus", "decode", TRANSFER),
    ("monitoring's other pod", "prefill", HTTP), ("monitoring's other pod", "gateway", 29000),
    ("tenant", "gateway", 29000), ("canary", "decode", HTTP),
    *[(outsider, target, port) for outsider in ("tenant", "tenant elsewhere", "canary", "another part-of pod")
      for target, port in (("prefill", BOOTSTRAP), ("prefill", HTTP), ("prefill", TRANSFER), ("decode", TRANSFER))
      if (outsider, target, port) != ("canary", "prefill", HTTP)],
    *[(component, "the internet", 443) for component in ("prefill", "decode", "gateway", "canary")],
    *[(component, "kube-dns", 8080) for component in ("prefill", "decode", "gateway", "canary")],
    *[(component, "kube-apiserver", 443) for component in ("prefill", "decode", "canary")],
    ("gateway", "kube-apiserver", 80), ("gateway", "the internet", 6443),
    *[("gateway", target, port) for target in ("prefill", "decode") for port in (443, 6443)],
]


def test_each_port_is_open_to_the_pods_that_need_it_and_shut_to_the_rest(network):
    policies, pods = network
    for source, target, port in OPEN:
        assert reaches(policies, pods[source], pods[target], port), f"{source} cannot reach {target}:{port}"
    for source, target, port in SHUT:
        assert not reaches(policies, pods[source], pods[target], port), f"{source} reaches {target}:{port}"
    for component in ("prefill", "decode", "gateway", "canary"):  # names resolve, over UDP and TCP
        assert reaches(policies, pods[component], pods["kube-dns"], 53, "UDP")
        assert reaches(policies, pods[component], pods["kube-dns"], 53, "TCP")
        kinds = {t for p in policies if _selected(p["spec"]["podSelector"], pods[component]["labels"])
                 for t in p["spec"]["policyTypes"]}
        assert kinds == {"Ingress", "Egress"}, f"{component}'s pods are fenced only for {kinds}"


# The Pod Security Standards' controls (kubernetes.io/docs/concepts/security/pod-security-standards,
# Kubernetes 1.32) a pod of this recipe can trip: each level's checks, as the admission plugin reads them.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def pod_security(spec: dict) -> dict[str, list[str]]:
    """What keeps a pod spec out of each Pod Security level (empty: it meets the level)."""
    pod_context = spec.get("securityContext", {})
    baseline = [key for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    baseline += [f"volume {v['name']} is a hostPath" for v in spec.get("volumes", []) if "hostPath" in v]
    restricted = [f"volume {v['name']} is {set(v) - {'name'}}" for v in spec.get("volumes", [])
                  if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    for c in spec["containers"] + spec.get("initContainers", []):
        context = c.get("securityContext", {})
        added = set(context.get("capabilities", {}).get("add", []))
        seccomp = context.get("seccompProfile", pod_context.get("seccompProfile", {})).get("type")
        beyond = added - BASELINE_CAPABILITIES
        baseline += [f"{c['name']}: {what}" for what, bad in (
            ("privileged", context.get("privileged")), (f"adds {sorted(beyond)}", beyond),
            ("a hostPort", any(p.get("hostPort") for p in c.get("ports", []))),
            ("seccomp Unconfined", seccomp == "Unconfined")) if bad]
        restricted += [f"{c['name']}: {what}" for what, bad in (
            ("allowPrivilegeEscalation is not false", context.get("allowPrivilegeEscalation") is not False),
            ("does not drop ALL capabilities", "ALL" not in context.get("capabilities", {}).get("drop", [])),
            (f"adds {sorted(added - {'NET_BIND_SERVICE'})}", added - {"NET_BIND_SERVICE"}),
            ("may run as root", not context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))
             or context.get("runAsUser", pod_context.get("runAsUser")) == 0),
            ("seccomp is not RuntimeDefault or Localhost", seccomp not in ("RuntimeDefault", "Localhost"))) if bad]
    return {"baseline": baseline, "restricted": baseline + restricted}


def _token_holders(spec: dict) -> list[str]:
    """The containers of a pod spec that mount a projected service-account token."""
    tokens = {v["name"] for v in spec.get("volumes", [])
              if any("serviceAccountToken" in s for s in v.get("projected", {}).get("sources", []))}
    return [c["name"] for c in spec["containers"] if any(m["name"] in tokens for m in c.get("volumeMounts", []))]


def test_every_pod_meets_pod_security_restricted_and_only_smg_holds_a_token_that_reads_pods(rendered):
    _, docs = rendered
    templates = pod_templates(docs)
    assert set(templates) == {"prefill", "decode", "gateway", "canary"}
    for component, template in templates.items():
        spec = template["spec"]
        assert pod_security(spec)["restricted"] == [], (component, pod_security(spec))
        assert spec["automountServiceAccountToken"] is False, f"{component} mounts a service-account token"
        assert _token_holders(spec) == (["gateway"] if component == "gateway" else []), component
    # smg's token: its own ServiceAccount, a Role in this namespace that reads pods and nothing else
    account = templates["gateway"]["spec"]["serviceAccountName"]
    [binding] = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert binding["kind"] == "RoleBinding" and binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    [role] = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    assert (role["kind"], role["metadata"]["name"]) == ("Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    smg = next(c for c in templates["gateway"]["spec"]["containers"] if c["name"] == "gateway")
    assert smg["securityContext"]["runAsUser"] > 0  # upstream's smg image names its user: runAsNonRoot needs a number
    # the checks bite: the servers' security context as first shipped (IPC_LOCK added) is refused at baseline already
    before = copy.deepcopy(templates["prefill"]["spec"])
    before["containers"][0]["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    assert pod_security(before)["baseline"] == ["server: adds ['IPC_LOCK']"]


def test_the_gate_judges_every_server_in_smgs_pool_and_never_asks_prefills_bootstrap_port(http_stand_in):
    """The gate's own probe (as rendered) reads smg's pool (GET /workers) and judges each server
    in it, two per role here, where a Service would have shown it one pod at random; the network
    policy keeps the gateway pod off prefill's bootstrap port, so the probe never asks it. (smg
    is a loopback stand-in here; tests/e2e/test_kubernetes_recipe.py runs the real one.)"""
    asked: list[str] = []
    bootstrap = http_stand_in(lambda path: (asked.append(path), (200, b'{"max_req_input_len": 1018}'))[1])
    info = {"version": "0.5.23+hardened.1", "max_total_num_tokens": 4096, "context_length": 1024,
            "max_req_input_len": 1018, "page_size": 1, "kv_cache_dtype": "auto",
            "disaggregation_transfer_backend": "mooncake",
            "disaggregation_bootstrap_port": int(bootstrap.split(":")[1]),
            "hardening": {"hardened": True, "base": "0.5.23", "deferred_decode_kv_release": True}}
    servers = {role: [f"http://{http_stand_in(lambda path: (200, json.dumps(info).encode()))}" for _ in range(2)]
               for role in ("prefill", "decode")}
    pool = {"workers": [{"url": url, "worker_type": role} for role, urls in servers.items() for url in urls]}
    smg = http_stand_in(lambda path: (200, json.dumps(pool).encode()) if path == "/workers" else (404, b""))
    [gate] = [c for c in pod_templates(render("lws"))["gateway"]["spec"]["containers"] if c["name"] == "preflight-gate"]
    probe = [arg.replace("http://127.0.0.1:8000", f"http://{smg}") for arg in gate["readinessProbe"]["exec"]["command"]]
    assert probe[:2] == ["sglang-hardened", "preflight"] and f"http://{smg}" in probe
    result = CliRunner().invoke(main, probe[1:], env={"GATEWAY_ADMIN_KEY": "k"})
    assert result.exit_code == 0, result.output
    assert all(url in result.output for urls in servers.values() for url in urls), result.output
    assert asked == [], f"the gate asked prefill's bootstrap port for {asked}"
    pool["workers"] = [w for w in pool["workers"] if w["worker_type"] == "prefill"]  # smg found no decode (yet)
    empty = CliRunner().invoke(main, probe[1:], env={"GATEWAY_ADMIN_KEY": "k"})
    assert empty.exit_code == 1 and "routes to no decode server" in empty.output, empty.output


def recipe_copy(tmp_path: Path, **changes: str) -> Path:
    """A copy of deploy/kubernetes as an operator edits it, with these parameters changed."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(RECIPE, tree, dirs_exist_ok=True)
    values = PARAMS.read_text()
    for key, value in changes.items():
        values, count = re.subn(rf"^{key}=.*$", f"{key}={value}", values, flags=re.M)
        assert count == 1, key
    (tree / "params" / "params.env").write_text(values)
    return tree


def run_check(tmp_path: Path, *options: str, **changes: str):
    tree = recipe_copy(tmp_path, **changes)
    return CliRunner().invoke(main, ["deploy", "check", str(tree / "params" / "params.env"), *options])


def test_deploy_check_passes_the_shipped_parameters_which_name_the_current_build(tmp_path):
    image = re.search(r"^IMAGE=\S+/(\S+)$", PARAMS.read_text(), re.M).group(1)
    base = image.split(":")[1].split("-")[0]
    version = hardened_version(base, load_series(patches_dir(), base).revision)
    assert image == default_tag(version)
    assert re.search(r"^TOOL_IMAGE=\S+/(\S+)$", PARAMS.read_text(), re.M).group(1) == default_tag(version, tool_only=True)
    result = run_check(tmp_path)
    assert result.exit_code == 0, result.output
    assert "deploy check: ok" in result.output
    # every overlay judged: its servers, and what the operator must create before applying it
    needs = ("Secret sglang-hardened-secrets/bootstrap-token, Secret sglang-hardened-secrets/gateway-admin-key, "
             "PVC sglang-hardened-model")
    rows = {line.split()[0]: " ".join(line.split()[1:]) for line in result.output.splitlines() if needs in line}
    assert rows == {os.path.relpath(tmp_path / "kubernetes" / overlay): f"{servers} {needs}"
                    for overlay, servers in (("lws", "prefill 2x1, decode 2x1"), ("rbg", "prefill 2x1, decode 2x1"),
                                             ("lws-multinode", "prefill 2x2, decode 2x2"))}, result.output


@pytest.mark.parametrize(("changes", "finding"), [
    ({"PREFILL_MAX_TOTAL_TOKENS": "16384"}, "KV pool holds 16384 tokens, fewer than the context length 32768"),
    ({"PREFILL_MAX_TOTAL_TOKENS": "16384"}, "accepts inputs up to 32762 tokens, a prefill only up to 16378"),
    # SGLang sizes a pool in whole pages: 32800 tokens of 64-token pages hold 32768
    ({"CONTEXT_LENGTH": "32790", "PREFILL_MAX_TOTAL_TOKENS": "32800", "PAGE_SIZE": "64"},
     "KV pool holds 32768 tokens, fewer than the context length 32790"),
    ({"DECODE_MAX_TOTAL_TOKENS": "8192"}, "KV pool holds 8192 tokens"),
    ({"IMAGE": "docker.io/lmsysorg/sglang:v0.5.23"}, "is not tagged as a hardened build"),
    ({"TOOL_IMAGE": "registry.example.com/sglang-hardened-tool:0.5.22-hardened.16"},
     "is not the tool image of"),
    ({"TRANSFER_BACKEND": "tcp"}, "'tcp' is not a backend the hardening covers"),
])
def test_deploy_check_refuses_unsafe_parameters_with_the_rule(tmp_path, changes, finding):
    result = run_check(tmp_path, **changes)
    assert result.exit_code == 1, result.output
    assert finding in " ".join(result.output.split()), result.output
    assert "deploy check: UNSAFE" in result.output


@pytest.mark.parametrize(("text", "message"), [
    ("IMAGE=a:0.5.23-hardened.1\nIMAGES=x\n", ":2: 'IMAGES' is not one of the recipe's parameters"),
    # a secret put here is refused without being echoed: it belongs in the Secret
    (f"{BOOTSTRAP_TOKEN.name}=s3cret-value\n", f":1: '{BOOTSTRAP_TOKEN.name}' is not one of the recipe's parameters"),
    ("IMAGE=a\nIMAGE=b\n", "IMAGE is set twice"),
    ("IMAGE=a\n", "no value for TOOL_IMAGE, GATEWAY_IMAGE"),
    ("IMAGE=a\nPAGE_SIZE=64   \n", ":2: PAGE_SIZE='64   ': the ConfigMap would hold it as written"),
    ("KV_CACHE_DTYPE=auto  # the default\n", ":1: KV_CACHE_DTYPE='auto  # the default'"),
    ('IMAGE="a:0.5.23-hardened.1"\n', "write the bare value"),
])
def test_deploy_check_names_what_is_wrong_with_a_bad_file(tmp_path, text, message):
    path = tmp_path / "params.env"
    path.write_text(text)
    result = CliRunner().invoke(main, ["deploy", "check", str(path)])
    assert result.exit_code == 1
    assert message in result.output
    assert "s3cret-value" not in result.output


def test_deploy_check_refuses_a_number_that_is_not_one(tmp_path):
    for value in ("32k", "²"):  # "²".isdigit() is true, and int() would raise
        result = run_check(tmp_path, CONTEXT_LENGTH=value)
        assert result.exit_code == 1  # and the message, not a traceback:
        assert f"CONTEXT_LENGTH={value!r} is not a positive whole number" in result.output
    missing = CliRunner().invoke(main, ["deploy", "check", str(tmp_path / "absent.env")])
    assert missing.exit_code == 1 and "cannot read the parameter file" in missing.output
    alone = tmp_path / "alone" / "params.env"  # a good file, but no recipe around it to judge
    alone.parent.mkdir()
    shutil.copy(PARAMS, alone)
    outside = CliRunner().invoke(main, ["deploy", "check", str(alone)])
    assert outside.exit_code == 1 and "is not in a copy of the recipe" in outside.output, outside.output


def _server_env(docs: list[dict], token: dict | None) -> None:
    """base/server-common.yaml with the bootstrap token's env entry replaced (None: removed)."""
    server = docs[0]["template"]["spec"]["containers"][0]
    server["env"] = [e for e in server["env"] if e["name"] != BOOTSTRAP_TOKEN.name] + ([token] if token else [])


def _smg_keys(docs: list[dict], value: str | None, env: list[dict] | None = None, more: tuple[str, ...] = ()) -> None:
    """base/gateway.yaml's smg with its control-plane key argument (None: none), env (None: as it
    is) and `more` arguments."""
    smg = docs[0]["spec"]["template"]["spec"]["containers"][0]
    command = smg["command"]
    if SMG_KEYS_FLAG in command:
        del command[command.index(SMG_KEYS_FLAG):command.index(SMG_KEYS_FLAG) + 2]
    command += ([SMG_KEYS_FLAG, value] if value else []) + list(more)
    if env is not None:
        smg["env"] = env


FROM_SECRET = {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "sglang-hardened-secrets", "key": "k"}}}
# each secret the recipe's defences need, unwired: base/'s file, the edit, what deploy check says (of
# each server, or of the gateway, in each overlay)
UNWIRED = {
    "token not set": ("server-common.yaml", lambda d: _server_env(d, None),
                      f"{BOOTSTRAP_TOKEN.name} is not set: anyone who reaches prefill's bootstrap port can replace a rank's "
                      "registration"),
    "token in the manifest": ("server-common.yaml", lambda d: _server_env(d, {"name": BOOTSTRAP_TOKEN.name, "value": "s3cret"}),
                              f"{BOOTSTRAP_TOKEN.name} is written into the manifest"),
    "token optional": ("server-common.yaml", lambda d: _server_env(d, {"name": BOOTSTRAP_TOKEN.name, "valueFrom": {
        "secretKeyRef": {"name": "sglang-hardened-secrets", "key": "bootstrap-token", "optional": True}}}),
        f"{BOOTSTRAP_TOKEN.name} is optional (Secret sglang-hardened-secrets): the pod starts without it"),
    "no smg key": ("gateway.yaml", lambda d: _smg_keys(d, None),
                   f"smg starts without {SMG_KEYS_FLAG}: whoever reaches its port removes workers"),
    "smg key in the manifest": ("gateway.yaml", lambda d: _smg_keys(d, "operator:operator:admin:s3cret"),
                                f"smg's {SMG_KEYS_FLAG} credential is written into the manifest"),
    "smg key from nothing": ("gateway.yaml", lambda d: _smg_keys(d, "operator:operator:admin:$(KEY)", []),
                             f"smg's {SMG_KEYS_FLAG} credential is not set"),
    "smg data-plane key in the manifest": ("gateway.yaml", lambda d: _smg_keys(
        d, "operator:operator:admin:$(KEY)", [FROM_SECRET], ("--api-key", "s3cret")),
        "smg's --api-key credential is written into the manifest"),
}


@pytest.mark.parametrize("case", UNWIRED)
def test_deploy_check_refuses_a_recipe_whose_secrets_are_not_wired_from_a_secret(tmp_path, case):
    file, edit, finding = UNWIRED[case]
    tree = recipe_copy(tmp_path)
    docs = list(yaml.safe_load_all((tree / "base" / file).read_text()))
    edit(docs)
    (tree / "base" / file).write_text(yaml.safe_dump_all(docs))
    result = CliRunner().invoke(main, ["deploy", "check", str(tree / "params" / "params.env")])
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    pods = 2 if file == "server-common.yaml" else 1
    assert said.count(finding) == pods * len(OVERLAYS), result.output
    assert "s3cret" not in said.replace("s3cret-", "")  # findings name the flaw, never the value


def test_deploy_check_judges_an_operators_own_overlay(tmp_path):
    """An overlay of the operator's own, on the recipe's, that gives decode another Secret key
    for the token than prefill's: prefill would refuse decode's registrations and reads."""
    tree = recipe_copy(tmp_path)
    decode = pod_templates(render("lws"))["decode"]["spec"]["containers"][0]
    at = [e["name"] for e in decode["env"]].index(BOOTSTRAP_TOKEN.name)
    site = tmp_path / "site"
    site.mkdir()
    key = f"/spec/leaderWorkerTemplate/workerTemplate/spec/containers/0/env/{at}/valueFrom/secretKeyRef/key"
    (site / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": ["../kubernetes/lws"],
        "patches": [{"target": {"kind": "LeaderWorkerSet", "name": "sglang-hardened-decode-group"},
                     "patch": yaml.safe_dump([{"op": "replace", "path": key, "value": "other-token"}])}]}))
    params = str(tree / "params" / "params.env")
    assert CliRunner().invoke(main, ["deploy", "check", params, "--overlay", str(tree / "lws")]).exit_code == 0
    result = CliRunner().invoke(main, ["deploy", "check", params, "--overlay", str(site)])
    assert result.exit_code == 1, result.output
    assert (f"prefill and decode take {BOOTSTRAP_TOKEN.name} from different Secret keys (prefill: sglang-hardened-secrets/"
            "bootstrap-token, decode: sglang-hardened-secrets/other-token)") in " ".join(result.output.split())


def test_no_service_of_the_recipe_is_one_a_workload_controller_takes_as_its_own(rendered):
    """LWS makes (or takes, if one exists) a headless Service named as each LeaderWorkerSet, and
    RBG one named <group>-<role> that it forces to clusterIP None: had one of the recipe's
    Services those names, RBG's reconcile would fail on prefill (and never create decode), and
    LWS's pods would get no per-pod DNS for a multi-node group."""
    _, docs = rendered
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    claimed = {d["metadata"]["name"] for d in docs if d["kind"] == "LeaderWorkerSet"}
    claimed |= {f"{d['metadata']['name']}-{role['name']}" for d in docs if d["kind"] == "RoleBasedGroup"
                for role in d["spec"]["roles"]}
    assert claimed and not services & claimed, services & claimed
