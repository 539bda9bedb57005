"""The Kubernetes recipe (deploy/kubernetes/) renders, validates and is safe as written.

No cluster is reachable here: every overlay is rendered with the real `kubectl kustomize`,
built-in kinds are validated against Kubernetes' own schemas (kubernetes-validate, pinned
version below) and LeaderWorkerSet and RoleBasedGroup against their CRDs' schemas vendored in
tests/kubernetes/crds/ (SOURCES.toml names each file's origin and hash). The network policy
is evaluated rule by rule; `deploy check` is run on the shipped and on unsafe parameters.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import re
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from sglang_hardened.cli import main
from sglang_hardened.common.paths import patches_dir
from sglang_hardened.image.build import default_tag
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.pipeline.stamp import hardened_version
from sglang_hardened.sandbox.recipe import RECIPE, pod_templates, render
from tests.harness import REPO

PARAMS = RECIPE / "params" / "params.env"
OVERLAYS = ("lws", "rbg")
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
    assert {"LeaderWorkerSet" if overlay == "lws" else "RoleBasedGroup"} <= kinds
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
    templates = pod_templates(docs)
    assert set(templates) == {"prefill", "decode", "gateway", "canary"}
    for component, template in templates.items():
        for container in template["spec"]["containers"]:
            assert container["image"] in (params["IMAGE"], params["GATEWAY_IMAGE"]), (component, container["image"])
            refs = set(re.findall(r"\$\((\w+)\)", " ".join(container.get("command", []) + container.get("args", []))))
            given = {e["name"] for e in container.get("env", [])}
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


def _selected(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def reaches(policies: list[dict], source: dict, target: dict, port: int) -> bool:
    """Whether a pod labelled `source` (in this namespace, or another one) reaches `target` on
    `port`: a peer's podSelector alone means this namespace; with a namespaceSelector, pods so
    labelled in the namespaces it selects."""
    applying = [p for p in policies if _selected(p["spec"]["podSelector"], target["labels"])]
    if not applying:
        return True

    def peer_matches(peer: dict) -> bool:
        in_namespace = (_selected(peer["namespaceSelector"], source["namespace_labels"]) if "namespaceSelector" in peer
                        else source["namespace"] == "recipe")
        return in_namespace and _selected(peer.get("podSelector", {}), source["labels"])

    for policy in applying:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from", [])
            by_peer = any(map(peer_matches, peers)) if peers else True
            ports = rule.get("ports")
            by_port = not ports or any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports)
            if by_peer and by_port:
                return True
    return False


def test_only_the_recipes_servers_and_gate_reach_prefills_bootstrap_port():
    docs = render("lws")
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    labels = {c: t["metadata"]["labels"] for c, t in pod_templates(docs).items()}
    labels["gateway"] = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]

    def pod(component: str, namespace: str = "recipe", **extra: str) -> dict:
        return {"labels": {**labels.get(component, {"app": component}), **extra}, "namespace": namespace,
                "namespace_labels": {"kubernetes.io/metadata.name": namespace}}

    prefill, gateway = pod("prefill"), pod("gateway")
    prometheus = pod("scraper", "monitoring", **{"app.kubernetes.io/name": "prometheus"})
    bootstrap, http = 8998, 30000
    assert reaches(policies, pod("decode"), prefill, bootstrap)
    assert reaches(policies, gateway, prefill, bootstrap)  # the preflight gate reads /hardened/limits
    assert reaches(policies, pod("prefill"), prefill, bootstrap)  # a multi-node group's ranks register there
    for outsider in (pod("canary"), pod("tenant-app"), pod("tenant-app", "other"), prometheus):
        assert not reaches(policies, outsider, prefill, bootstrap), outsider
    assert reaches(policies, prometheus, prefill, http) and reaches(policies, prometheus, gateway, 29000)
    for outsider in (pod("other-app", "monitoring"), pod("tenant-app")):  # the whole API is on that port
        assert not reaches(policies, outsider, prefill, http) and not reaches(policies, outsider, pod("decode"), http)
        assert not reaches(policies, outsider, gateway, 29000)
    assert reaches(policies, pod("tenant-app", "other"), gateway, 8000)  # clients come through the gateway
    assert reaches(policies, pod("prefill"), pod("decode"), 17000)  # the transfer's TCP side


def run_check(tmp_path: Path, **changes: str):
    values = PARAMS.read_text()
    for key, value in changes.items():
        values, count = re.subn(rf"^{key}=.*$", f"{key}={value}", values, flags=re.M)
        assert count == 1, key
    path = tmp_path / "params.env"
    path.write_text(values)
    return CliRunner().invoke(main, ["deploy", "check", str(path)])


def test_deploy_check_passes_the_shipped_parameters_which_name_the_current_build(tmp_path):
    image = re.search(r"^IMAGE=\S+/(\S+)$", PARAMS.read_text(), re.M).group(1)
    base = image.split(":")[1].split("-")[0]
    assert image == default_tag(hardened_version(base, load_series(patches_dir(), base).revision))
    result = run_check(tmp_path)
    assert result.exit_code == 0, result.output
    assert "deploy check: ok" in result.output


@pytest.mark.parametrize(("changes", "finding"), [
    ({"PREFILL_MAX_TOTAL_TOKENS": "16384"}, "KV pool holds 16384 tokens, fewer than the context length 32768"),
    ({"PREFILL_MAX_TOTAL_TOKENS": "16384"}, "accepts inputs up to 32762 tokens, a prefill only up to 16378"),
    # SGLang sizes a pool in whole pages: 32800 tokens of 64-token pages hold 32768
    ({"CONTEXT_LENGTH": "32790", "PREFILL_MAX_TOTAL_TOKENS": "32800", "PAGE_SIZE": "64"},
     "KV pool holds 32768 tokens, fewer than the context length 32790"),
    ({"DECODE_MAX_TOTAL_TOKENS": "8192"}, "KV pool holds 8192 tokens"),
    ({"IMAGE": "docker.io/lmsysorg/sglang:v0.5.23"}, "is not tagged as a hardened build"),
    ({"TRANSFER_BACKEND": "tcp"}, "'tcp' is not a backend the hardening covers"),
])
def test_deploy_check_refuses_unsafe_parameters_with_the_rule(tmp_path, changes, finding):
    result = run_check(tmp_path, **changes)
    assert result.exit_code == 1, result.output
    assert finding in " ".join(result.output.split()), result.output
    assert "deploy check: UNSAFE" in result.output


@pytest.mark.parametrize(("text", "message"), [
    ("IMAGE=a:0.5.23-hardened.1\nIMAGES=x\n", "'IMAGES=x' is not one of KEY=VALUE"),
    ("IMAGE=a\nIMAGE=b\n", "IMAGE is set twice"),
    ("IMAGE=a\n", "no value for GATEWAY_IMAGE"),
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


def test_deploy_check_refuses_a_number_that_is_not_one(tmp_path):
    for value in ("32k", "²"):  # "²".isdigit() is true, and int() would raise
        result = run_check(tmp_path, CONTEXT_LENGTH=value)
        assert result.exit_code == 1  # and the message, not a traceback:
        assert f"CONTEXT_LENGTH={value!r} is not a positive whole number" in result.output
    missing = CliRunner().invoke(main, ["deploy", "check", str(tmp_path / "absent.env")])
    assert missing.exit_code == 1 and "cannot read the parameter file" in missing.output


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
