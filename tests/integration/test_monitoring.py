"""The monitoring component (deploy/kubernetes/monitoring/): scrape config, alerts and dashboard
as an overlay applies them, held to the runtime's metric definitions (runtime/metrics.py).

The overlay is rendered with the real `kubectl kustomize` (a site overlay that takes the recipe's
`lws` and adds the component, as docs/kubernetes.md says). The PrometheusRule's rules go through
Debian's `promtool` (package `prometheus`, installed here as root the way the image tests install
buildah): `check rules`, then `test rules` with a quiet cluster, as a hardened server exports it
from its start (every listed series at 0, build info), on which no alert fires, and one event per
alert that fires it and no other. The Prometheus Operator's CRD schemas are not vendored here: the
PodMonitor is checked against the rendered pods it must select instead.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from sglang_hardened.operations.deploy_wiring import pod_templates, render
from sglang_hardened.runtime import metrics
from sglang_hardened.runtime.outcomes import WATCHERS_MAX
from sglang_hardened.runtime.release_timeout import release_timeout_s
from sglang_hardened.runtime.source_hold import HOLD_TIMEOUTS
from sglang_hardened.sandbox.recipe import RECIPE
from tests.harness import REPO

SITE_OVERLAY = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [../lws]
components: [../monitoring]
"""
METRICS_DOC = REPO / "docs" / "metrics.md"
LABEL_WORDS = {  # the fixed list each label of a sglang_hardened_* selector takes its values from
    "id": set(metrics.REFUSALS), "role": set(metrics.ROLES),
    "ended_by": {w for ws in metrics.HOLD_ENDS.values() for w in ws},
    "result": set(metrics.POLL_RESULTS), "metric": set(metrics.SPECS), "op": set(metrics.TAG_OPS),
    "reason": {*metrics.STOPS, *(r for by_role in metrics.REFUSALS.values() for rs in by_role.values() for r in rs)}}


@functools.cache
def rendered() -> tuple[dict, ...]:
    """A site overlay of the recipe's `lws` with the monitoring component, as docs/kubernetes.md
    writes it, rendered in a copy of the recipe (kustomize takes relative roots only)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "kubernetes"
        shutil.copytree(RECIPE, tree)
        (tree / "site").mkdir()
        (tree / "site" / "kustomization.yaml").write_text(SITE_OVERLAY)
        return tuple(render(tree / "site"))


def _one(kind: str) -> dict:
    (doc,) = [d for d in rendered() if d["kind"] == kind]
    return doc


def _rules() -> list[dict]:
    return [r for group in _one("PrometheusRule")["spec"]["groups"] for r in group["rules"]]


def _dashboard() -> dict:
    config = next(d for d in rendered()
                  if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "sglang-hardened-dashboard")
    assert config["metadata"]["labels"] == {"grafana_dashboard": "1"}
    (text,) = config["data"].values()
    return json.loads(text)


def _exprs() -> list[str]:
    """Every PromQL expression the rules and the dashboard evaluate."""
    return [r["expr"] for r in _rules()] + [t["expr"] for p in _dashboard()["panels"] for t in p["targets"]]


def served_names() -> set[str]:
    """The sample names /metrics serves for runtime/metrics.py's SPECS."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("",),
                "health": ("",)}
    return {metrics.family(name) + s for name, (kind, *_) in metrics.SPECS.items() for s in suffixes[kind]}


def test_every_metric_and_label_word_the_rules_and_dashboard_name_is_one_the_runtime_serves():
    """One source of truth: a metric renamed or a reason misspelt in runtime/metrics.py, or in a
    rule or panel, fails here, not as an alert that can never fire. Every family the runtime
    defines has a panel."""
    names = served_names()
    used = set()
    for expr in _exprs():
        for name, matchers in re.findall(r"\b(sglang_hardened_\w+)(?:\{([^}]*)\})?", expr):
            assert name in names, f"{name} is not served (runtime/metrics.py): {expr}"
            used.add(name)
            for label, value in re.findall(r'(\w+)\s*=~?\s*"([^"]*)"', matchers):
                if label in LABEL_WORDS:
                    assert set(value.split("|")) <= LABEL_WORDS[label], f"{label}={value!r}: {expr}"
    panels = " ".join(t["expr"] for p in _dashboard()["panels"] for t in p["targets"])
    assert all(metrics.family(name) in panels for name in metrics.SPECS), "a family without a panel"
    assert "sglang_hardened_not_a_metric" not in names  # the check bites on an unknown name


def test_alerts_carry_severity_summary_and_a_runbook_section_of_the_docs():
    headings = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", METRICS_DOC.read_text(), re.M)}
    rules = _rules()
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        doc, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert doc == "docs/metrics.md" and anchor == rule["alert"].lower() and anchor in headings, rule["alert"]


def test_thresholds_are_the_runtimes_own_numbers():
    """A rule's number that stands for a runtime constant is that constant: the followers' cap
    (runtime/outcomes.py) and 80 % of a prefill hold's limit (HOLD_TIMEOUTS release timeouts)."""
    expr = {r["alert"]: r["expr"] for r in _rules()}
    assert expr["SGLangHardenedOutcomeFollowersAtCap"].endswith(f">= {WATCHERS_MAX}")
    limit = HOLD_TIMEOUTS * release_timeout_s({})
    assert expr["SGLangHardenedHoldNearItsLimit"].endswith(f"> {0.8 * limit:g}")


def test_the_pod_monitors_select_the_servers_and_the_gateway_on_their_metrics_ports():
    """kube-prometheus-stack ignores the pods' prometheus.io/* annotations: the PodMonitors must
    select each server's pod and the gateway's (not the canary's), on a port each pod names."""
    templates = pod_templates(list(rendered()))
    monitors = {d["metadata"]["name"]: d["spec"] for d in rendered() if d["kind"] == "PodMonitor"}
    scraped = {}
    for component, template in templates.items():
        labels = template["metadata"]["labels"]
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        for spec in monitors.values():
            selector = spec["selector"]
            chosen = selector["matchLabels"].items() <= labels.items() and all(
                labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))
            if chosen:
                (endpoint,) = spec["podMetricsEndpoints"]
                assert endpoint["port"] in ports, (component, endpoint["port"])
                scraped[component] = ports[endpoint["port"]]
    assert scraped == {"prefill": 30000, "decode": 30000, "gateway": 29000}
    assert all(e["path"] == "/metrics" for spec in monitors.values() for e in spec["podMetricsEndpoints"])
    assert all("--enable-metrics" in templates[role]["spec"]["containers"][0]["args"] for role in ("prefill", "decode"))


@pytest.fixture(scope="module")
def promtool() -> str:
    """Debian's promtool, installed as root where it is missing (as the image tests do buildah)."""
    if shutil.which("promtool") is None:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]
        for cmd in (["apt-get", "update", "-qq"], install):
            subprocess.run(cmd, check=True, capture_output=True, env=env)
    found = shutil.which("promtool")
    assert found, "promtool is missing: apt-get install prometheus (Debian's package carries it)"
    return found


def _rules_file(folder: Path, spec: dict) -> Path:
    """The PrometheusRule's spec as the rule file Prometheus (and promtool) reads."""
    (folder / "rules.yaml").write_text(yaml.safe_dump(spec))
    return folder / "rules.yaml"


def test_promtool_checks_the_rules(promtool, tmp_path):
    rules = _rules_file(tmp_path, _one("PrometheusRule")["spec"])
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert done.returncode == 0 and f"SUCCESS: {len(_rules())} rules found" in done.stdout, done.stdout + done.stderr


# --- promtool test rules: a quiet cluster, then one event per alert -------------------------------

HOURS = 4
STEPS = HOURS * 60  # one sample a minute
SERVER = {"prefill": {"namespace": "llm", "pod": "prefill-0", "job": "llm/servers", "instance": "prefill-0:30000",
                      "component": "prefill"},
          "decode": {"namespace": "llm", "pod": "decode-0", "job": "llm/servers", "instance": "decode-0:30000",
                     "component": "decode"}}
BUILD = {"version": "0.5.23+hardened.12", "base": "0.5.23", "series_revision": "12", "tool_version": "0.1.0",
         "hardening_ids": "H0,H2,H3,H4,H5,H6,H7,H8,H11,H12,H13,H14,H15"}
CANARY = {"namespace": "llm", "cronjob": "sglang-hardened-canary"}
RISING = f"0+1x{STEPS}"
STEP_AT_2M = f"0x2 1x{STEPS - 2}"  # 0, 0, then 1 from the third minute on


def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def quiet() -> dict[str, str]:
    """A quiet cluster as Prometheus scrapes it: each server's listed series at 0 (runtime's
    `listed`, what `at_start` writes), its build info, its metrics health at 1 and SGLang's own
    context length, and a canary that passes every minute."""
    series = {}
    for server in SERVER.values():
        for name, (kind, *_) in metrics.SPECS.items():
            if kind in ("counter", "gauge"):
                sample = metrics.family(name) + ("_total" if kind == "counter" else "")
                for labels in metrics.listed(name):
                    series[_series(sample, {**server, **labels})] = f"0x{STEPS}"
        series[_series("sglang_hardened_build_info", {**server, **BUILD})] = f"1x{STEPS}"
        series[_series("sglang_hardened_metrics_healthy", server)] = f"1x{STEPS}"
        series[_series("sglang:context_len", server)] = f"1024x{STEPS}"
    for name in ("kube_cronjob_status_last_schedule_time", "kube_cronjob_status_last_successful_time"):
        series[_series(name, CANARY)] = f"0+60x{STEPS}"  # seconds since the test's start
    return series


def _refused(server: str, hid: str, reason: str) -> str:
    labels = {**SERVER[server], "id": hid, "role": server, "reason": reason}
    return _series("sglang_hardened_requests_refused_total", labels)


def _hold_buckets() -> dict[str, str]:
    """Prefill holds that each last between 30 and 60 s (the bucket below the limit), one a minute."""
    return {_series("sglang_hardened_hold_seconds_bucket", {**SERVER["prefill"], "role": "prefill", "le": le}): values
            for le, values in (("30.0", f"0x{STEPS}"), ("60.0", RISING), ("+Inf", RISING))}


# alert: (series that differ from the quiet cluster's (None: absent), minutes after which it fires)
EVENTS: dict[str, tuple[dict[str, str | None], int]] = {
    "SGLangHardenedPageTagMismatch": ({_refused("decode", "H8", "tag_mismatch"): STEP_AT_2M}, 3),
    "SGLangHardenedDecodeFailedClosed": ({_refused("decode", "H8", "fail_closed"): STEP_AT_2M}, 3),
    "SGLangHardenedTransferCoverageRefused": ({_refused("decode", "H3", "prompt_length_differs"): STEP_AT_2M}, 3),
    "SGLangHardenedRolesConfiguredApart": ({_refused("decode", "H7", "limit_below_decode"): STEP_AT_2M}, 3),
    "SGLangHardenedMetadataLost": ({_refused("decode", "H13", "metadata_lost"): STEP_AT_2M}, 3),
    "SGLangHardenedPrefillHoldRanOut": ({_series("sglang_hardened_holds_ended_total", {
        **SERVER["prefill"], "role": "prefill", "ended_by": "ran_out"}): STEP_AT_2M}, 3),
    "SGLangHardenedHoldsKeepStarting": ({_series("sglang_hardened_holds_started_total", {
        **SERVER["prefill"], "role": "prefill"}): RISING}, 45),
    "SGLangHardenedRoomsHeldGrowing": ({_series("sglang_hardened_rooms_held", {
        **SERVER["decode"], "role": "decode"}): RISING}, 200),
    "SGLangHardenedHoldNearItsLimit": (_hold_buckets(), 35),
    "SGLangHardenedSendDeadline": ({_series("sglang_hardened_transfer_sends_stopped_total", {
        **SERVER["prefill"], "reason": "send_deadline"}): STEP_AT_2M}, 3),
    "SGLangHardenedOutcomeFollowersAtCap": ({_series("sglang_hardened_outcome_followers", SERVER["decode"]):
                                             f"{WATCHERS_MAX}x{STEPS}"}, 20),
    "SGLangHardenedOutcomePollsFailing": ({_series("sglang_hardened_outcome_polls_total", {
        **SERVER["decode"], "result": "unreadable"}): RISING}, 45),
    "SGLangHardenedMetricWritesFailing": ({_series("sglang_hardened_metric_errors_total", {
        **SERVER["prefill"], "metric": "hold_seconds"}): STEP_AT_2M}, 3),
    "SGLangHardenedMetricsUnhealthy": ({_series("sglang_hardened_metrics_healthy", SERVER["decode"]):
                                        f"1x2 0x{STEPS - 2}"}, 8),
    "SGLangHardenedServerNotHardened": (
        {_series("sglang_hardened_build_info", {**SERVER["decode"], **BUILD}): None}, 15),
    "SGLangHardenedMixedBuilds": ({
        _series("sglang_hardened_build_info", {**SERVER["decode"], **BUILD}): None,
        _series("sglang_hardened_build_info", {**SERVER["decode"], **BUILD, "version": "0.5.23+hardened.14",
                                               "series_revision": "13"}): f"1x{STEPS}"}, 70),
    "SGLangHardenedCanaryFailed": ({_series("kube_cronjob_status_last_successful_time", CANARY): f"0x{STEPS}"}, 40),
    "SGLangHardenedCanaryStale": ({_series("kube_cronjob_status_last_schedule_time", CANARY): f"0x{STEPS}",
                                   _series("kube_cronjob_status_last_successful_time", CANARY): f"0x{STEPS}"}, 70),
}
FIRING = 'count by (alertname) (ALERTS{alertstate="firing"})'


def _inputs(series: dict[str, str | None]) -> list[dict[str, str]]:
    return [{"series": name, "values": values} for name, values in series.items() if values is not None]


def _fires(alert: str, changed: dict[str, str | None], minutes: int) -> dict:
    """A promtool test: ``alert`` alone fires ``minutes`` after the start, and none before the event."""
    return {"name": alert, "interval": "1m", "input_series": _inputs({**quiet(), **changed}), "promql_expr_test": [
        {"expr": FIRING, "eval_time": "1m", "exp_samples": []},
        {"expr": FIRING, "eval_time": f"{minutes}m",
         "exp_samples": [{"labels": f'{{alertname="{alert}"}}', "value": 1}]}]}


def _promtool_test(promtool: str, folder: Path, spec: dict, tests: list[dict]) -> subprocess.CompletedProcess:
    _rules_file(folder, spec)
    (folder / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                       "tests": tests}))
    return subprocess.run([promtool, "test", "rules", str(folder / "tests.yaml")], capture_output=True, text=True)


def test_each_alert_fires_on_its_event_alone_and_none_on_a_quiet_cluster(promtool, tmp_path):
    """`promtool test rules`: on the quiet cluster no alert fires over four hours; each event
    fires its alert, and only it, once its window and `for` have passed."""
    assert set(EVENTS) == {r["alert"] for r in _rules()}, "every alert has its event"
    tests = [{"name": "a quiet cluster", "interval": "1m", "input_series": _inputs(quiet()),
              "promql_expr_test": [{"expr": FIRING, "eval_time": f"{m}m", "exp_samples": []}
                                   for m in (1, 10, 60, 120, STEPS - 1)]}]
    tests += [_fires(alert, changed, minutes) for alert, (changed, minutes) in EVENTS.items()]
    done = _promtool_test(promtool, tmp_path, _one("PrometheusRule")["spec"], tests)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_a_misspelt_rule_fails_promtools_test(promtool, tmp_path):
    """The test bites: a rule whose matcher a typo changed never fires on its event."""
    spec = copy.deepcopy(_one("PrometheusRule")["spec"])
    first = spec["groups"][0]["rules"][0]
    first["expr"] = first["expr"].replace("tag_mismatch", "tag_mismatches")
    done = _promtool_test(promtool, tmp_path, spec, [_fires(first["alert"], *EVENTS[first["alert"]])])
    assert done.returncode != 0 and first["alert"] in done.stdout + done.stderr
