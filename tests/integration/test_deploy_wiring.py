"""`deploy check` judges what the rendered recipe would run, and refuses what the recipe cannot run.

Gate tier, no cluster: a copy of deploy/kubernetes is edited as an operator would (a file of
base/, params.env, or an overlay of their own) and rendered with the real `kubectl kustomize`;
each case shows the one rule that catches that edit, with the cause named and exit status 1
(a warning alone exits 0). Cost: one or two renders a case, about 1 s each.
"""

from __future__ import annotations

import re

import pytest
import yaml
from click.testing import CliRunner

from sglang_hardened.cli import main
from sglang_hardened.common import knobs
from sglang_hardened.operations.deploy_shape import LWS_LEADER_LABEL
from sglang_hardened.operations.deploy_wiring import render as kustomize
from sglang_hardened.sandbox.recipe import render
from tests.integration.test_kubernetes_recipe import crd_schemas, recipe_copy, validate


def check(tree, *overlays: str):
    """deploy check on a recipe copy's params.env, judging these overlays of it (default: lws)."""
    names = [a for o in overlays or ("lws",) for a in ("--overlay", str(tree / o))]
    result = CliRunner().invoke(main, ["deploy", "check", str(tree / "params" / "params.env"), *names])
    return result.exit_code, " ".join(result.output.split())


def judged(status: int, said: str, severity: str | None, finding: str, quiet: str) -> None:
    """deploy check's verdict on one change: an unsafe finding exits 1, a warning alone 0 and says
    ``finding`` (a pattern); no finding exits 0 and says nothing of ``quiet``."""
    assert status == (1 if severity == "unsafe" else 0), said
    if severity:
        assert re.search(finding, said), said
    else:
        assert quiet not in said, said


def edit(tree, file: str, change) -> None:
    """Change one YAML file of the copy (every document in it) with `change(docs)`."""
    path = tree / file
    docs = list(yaml.safe_load_all(path.read_text()))
    change(docs)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def smg(docs):
    return docs[0]["spec"]["template"]["spec"]["containers"][0]


def gate(docs):
    return docs[0]["spec"]["template"]["spec"]["containers"][1]


def static_smg(docs) -> None:
    """smg as the recipe ran it with one server per role: the role Services as its static workers."""
    smg(docs)["command"] = ["smg", "launch", "--pd-disaggregation", "--prefill", "http://sglang-hardened-prefill:30000",
                            "8998", "--decode", "http://sglang-hardened-decode:30000", "--control-plane-api-keys",
                            "operator:sglang-hardened operator:admin:$(GATEWAY_ADMIN_KEY)"]


def without(flag: str, values: int = 1):
    def change(docs):
        command = smg(docs)["command"]
        at = command.index(flag)
        del command[at:at + 1 + values]
    return change


def decode_selects(*labels: str):
    def change(docs):
        command = smg(docs)["command"]
        at = command.index("--decode-selector")
        command[at + 1:at + 3] = list(labels)
    return change


def server_template(role: str):
    return lambda docs: next(d for d in docs if d["metadata"]["name"] == f"sglang-hardened-{role}")["template"]


def drop_annotation(docs) -> None:
    server_template("prefill")(docs)["metadata"].pop("annotations")


def drop_model_mount(docs) -> None:
    container = docs[0]["template"]["spec"]["containers"][0]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "model"]


def lws_replicas(value: int):
    def change(docs):
        docs[0]["spec"]["replicas"] = value
    return change


def role_grants(rule: dict):
    def change(docs):
        docs[1]["rules"].append(rule)
    return change


def cluster_binding(docs) -> None:
    docs[2]["kind"] = "ClusterRoleBinding"
    docs[2]["roleRef"]["kind"] = "ClusterRole"


# (file of the copy, the edit, what deploy check says): each a way the recipe would start and then
# misroute, misjudge or fail
UNSAFE = {
    "smg static with two servers": ("base/gateway.yaml", static_smg,
                                    "runs 2 servers but smg is given static URLs: it pairs through a Service"),
    "gate on Services": ("base/gateway.yaml", lambda d: gate(d)["readinessProbe"]["exec"].update(command=[
        "sglang-hardened", "preflight", "--prefill", "http://sglang-hardened-prefill:30000",
        "--decode", "http://sglang-hardened-decode:30000"]), "but the gate judges the URLs it is given"),
    "smg in every namespace": ("base/gateway.yaml", without("--service-discovery-namespace"),
                               "smg watches every namespace (no --service-discovery-namespace)"),
    "smg on the wrong port": ("base/gateway.yaml", without("--service-discovery-port"),
                              "smg connects to discovered pods on port its default"),
    "decode selector picks prefills": ("base/gateway.yaml", decode_selects("app.kubernetes.io/part-of=sglang-hardened",
                                                                            "app.kubernetes.io/component=prefill"),
                                       "smg's --decode-selector also selects LeaderWorkerSet/sglang-hardened-prefill-"
                                       "group's prefill pods"),
    "decode selector picks nothing": ("base/gateway.yaml", decode_selects("app=decode", "tier=gpu"),
                                      "does not select LeaderWorkerSet/sglang-hardened-decode-group's pods: smg never "
                                      "routes to them"),
    "no bootstrap annotation": ("base/server.yaml", drop_annotation,
                                "the pods' sglang.ai/bootstrap-port annotation is None, their bootstrap port 8998"),
    "model not mounted": ("base/server-common.yaml", drop_model_mount,
                          "no volume is mounted at /models/model (MODEL_PATH), which --model-path reads"),
    "no prefill running": ("lws/leaderworkersets.yaml", lws_replicas(0),
                           "replicas 0: no prefill server runs, and every request fails"),
    "gateway may read Secrets": ("base/rbac.yaml", role_grants({"apiGroups": [""], "resources": ["secrets"],
                                                                  "verbs": ["get"]}),
                                 "the gateway's ServiceAccount sglang-hardened-gateway is allowed get on secrets"),
    "gateway may delete pods": ("base/rbac.yaml", role_grants({"apiGroups": [""], "resources": ["pods"],
                                                                 "verbs": ["delete"]}), "is allowed delete on pods"),
    "gateway holds a ClusterRole": ("base/rbac.yaml", cluster_binding,
                                    "holds a ClusterRole: its token reads (or writes) beyond this namespace"),
}


@pytest.mark.parametrize("case", UNSAFE)
def test_deploy_check_refuses_what_the_recipe_cannot_run_naming_the_cause(tmp_path, case):
    file, change, finding = UNSAFE[case]
    tree = recipe_copy(tmp_path)
    edit(tree, file, change)
    status, said = check(tree)
    assert status == 1 and "deploy check: UNSAFE" in said, said
    assert finding in said, said


def test_a_multi_node_group_must_take_its_place_from_lws(tmp_path):
    """Raising LWS's size alone makes each pod of a group start a server of its own (and probes
    the workers, which serve no HTTP, and lets smg pair them): refused. The lws-multinode
    overlay, which wires each, passes."""
    tree = recipe_copy(tmp_path)
    (tree / "bigger").mkdir()
    (tree / "bigger" / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": ["../lws"],
        "patches": [{"target": {"kind": "LeaderWorkerSet"}, "patch": yaml.safe_dump(
            [{"op": "replace", "path": "/spec/leaderWorkerTemplate/size", "value": 2}])}]}))
    status, said = check(tree, "bigger")
    assert status == 1, said
    for flag, var in (("--dist-init-addr", "LWS_LEADER_ADDRESS"), ("--nnodes", "LWS_GROUP_SIZE"),
                      ("--node-rank", "LWS_WORKER_INDEX")):
        assert f"size 2 but {flag} is not taken from {var}: each pod of the group starts a server of its own" in said
    assert "the group's workers have HTTP probes" in said
    assert "selects the workers of LeaderWorkerSet/sglang-hardened-prefill-group's groups" in said
    assert check(tree, "lws-multinode")[0] == 0


@pytest.mark.parametrize(("image", "severity", "finding"), [
    ("registry.example.com/smg", "unsafe", "names no tag or digest"),
    ("registry.example.com/smg:latest", "warn", "is a moving tag"),
    ("registry.example.com:5000/smg", "unsafe", "names no tag or digest"),
    (f"registry.example.com/smg:1.13.0@sha256:{'0' * 64}", None, ""),
])
def test_every_image_is_pinned(tmp_path, image, severity, finding):
    judged(*check(recipe_copy(tmp_path, GATEWAY_IMAGE=image)), severity,
           rf"{severity} \S*lws gateway image '?{re.escape(image)}'? {finding}", quiet="warn")


def test_the_hardenings_server_knobs_are_taken_in_the_parameter_file_and_a_weakening_one_refused(tmp_path):
    """params.env reaches both servers through envFrom, where the hardening reads its knobs: an
    operator sets H6's link rate there. The names and types are the registry's (common/knobs.py);
    a value its type refuses, the bootstrap token (a secret) and a knob that gives up a guarantee
    are refused."""
    tree = recipe_copy(tmp_path)
    params = tree / "params" / "params.env"
    shipped = params.read_text()
    rate = f"{knobs.TRANSFER_LINK_RATE.name}=2.5e10\n{knobs.PAGE_TAGS_FAIL_CLOSED.name}=1\n"
    params.write_text(shipped + rate)
    status, said = check(tree)
    assert status == 0, said
    config = next(d for d in render("lws", params.read_text()) if d["kind"] == "ConfigMap")
    assert config["data"][knobs.TRANSFER_LINK_RATE.name] == "2.5e10"
    params.write_text(shipped + f"{knobs.TRANSFER_LINK_RATE.name}=fast\n")
    status, said = check(tree)
    assert status == 1 and f"{knobs.TRANSFER_LINK_RATE.name}='fast': give a number" in said, said
    params.write_text(shipped + f"{knobs.ALLOW_UNSAFE_KV_LIMITS.name}=1\n")
    status, said = check(tree)
    assert status == 1 and f"{knobs.ALLOW_UNSAFE_KV_LIMITS.name}=1 gives up part of H7" in said, said
    params.write_text(shipped + f"{knobs.BOOTSTRAP_TOKEN.name}=s3cret\n")
    status, said = check(tree)
    assert status == 1 and "is not one of the recipe's parameters" in said and "s3cret" not in said, said


@pytest.mark.parametrize(("cidr", "finding"), [
    ("0.0.0.0/0", "the gateway may reach every address on the API server's ports"),
    ("10.0.0.1/33", "KUBERNETES_API_CIDR"),
])
def test_the_api_servers_addresses_are_an_address(tmp_path, cidr, finding):
    status, said = check(recipe_copy(tmp_path, KUBERNETES_API_CIDR=cidr))
    assert status == 1 and finding in said, said


def test_rbg_scales_through_its_adapter_and_rolls_both_roles_together(tmp_path):
    """The autoscaling component's HPA targets the scaling adapter RBG makes for a role whose
    adapter is on (<group>-<role>); the CoordinatedPolicy RBG reads is named as the group and
    names both its roles. Both validate against their schemas (HPA: Kubernetes'; the policy: the
    vendored CRD)."""
    tree = recipe_copy(tmp_path)
    (tree / "site").mkdir()
    (tree / "site" / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["../rbg"], "components": ["../autoscaling"]}))
    docs = kustomize(tree / "site")
    [group] = [d for d in docs if d["kind"] == "RoleBasedGroup"]
    [hpa] = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    [policy] = [d for d in docs if d["kind"] == "CoordinatedPolicy"]
    adapters = {f"{group['metadata']['name']}-{r['name']}" for r in group["spec"]["roles"]
                if r.get("scalingAdapter", {}).get("enable")}
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "RoleBasedGroupScalingAdapter"
    assert hpa["spec"]["scaleTargetRef"]["name"] in adapters
    assert policy["metadata"]["name"] == group["metadata"]["name"]
    assert [p["roles"] for p in policy["spec"]["policies"]] == [[r["name"] for r in group["spec"]["roles"]]]
    for doc in (group, hpa, policy):
        validate(doc, crd_schemas())
    assert check(tree, "site")[0] == 0


def test_a_multi_node_groups_leaders_alone_serve_and_are_selected():
    """lws-multinode: every pod of a group runs the role's command with its place from LWS; only
    the leader has probes; the role Services and smg's selectors take leaders only."""
    docs = render("lws-multinode")
    for lws in (d for d in docs if d["kind"] == "LeaderWorkerSet"):
        template = lws["spec"]["leaderWorkerTemplate"]
        assert template["size"] >= 2
        leader, worker = (template[t]["spec"]["containers"][0] for t in ("leaderTemplate", "workerTemplate"))
        assert leader["args"] == worker["args"]
        args = " ".join(worker["args"])
        assert re.search(r"--dist-init-addr \$\(LWS_LEADER_ADDRESS\):\d+ --nnodes \$\(LWS_GROUP_SIZE\) "
                         r"--node-rank \$\(LWS_WORKER_INDEX\)", args), args
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(leader)
        assert not any(k.endswith("Probe") for k in worker)
    for service in (d for d in docs if d["kind"] == "Service" and "gateway" not in d["metadata"]["name"]):
        assert service["spec"]["selector"][LWS_LEADER_LABEL] == "0"
    command = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["command"]
    for flag in ("--prefill-selector", "--decode-selector"):
        at = command.index(flag)
        assert f"{LWS_LEADER_LABEL}=0" in command[at + 1:at + 4]


@pytest.mark.parametrize(("cidr", "severity"), [("0.0.0.0/0", "unsafe"), ("10.0.0.0/8", "warn"),
                                                ("fd00::/48", "warn"), ("10.0.0.1/32", None)])
def test_the_api_server_block_is_narrow(tmp_path, cidr, severity):
    """The gateway's only way out of the namespace is the API server's block: everything is refused,
    a block wider than a /24 (IPv6 /64) warned of, since it opens the API ports of that many hosts."""
    judged(*check(recipe_copy(tmp_path, KUBERNETES_API_CIDR=cidr)), severity,
           rf"{severity}\s+KUBERNETES_API_CIDR\s+the gateway may reach", quiet="the gateway may reach")
