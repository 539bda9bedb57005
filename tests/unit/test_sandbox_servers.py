"""The many-replica sandbox's pure parts: server names, pools and ports, every load balancer's
command line naming every server, and what ``sandbox status --json`` lists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from sglang_hardened.common.knobs import CACHE
from sglang_hardened.lb.cli import lb
from sglang_hardened.sandbox import cluster as sbc
from sglang_hardened.sandbox.cli import sandbox
from sglang_hardened.sandbox.cluster import LBS, Cluster, ClusterParams, Proc
from sglang_hardened.sandbox.env import SandboxEnv, SandboxError
from sglang_hardened.sandbox.servers import role_of, server_names

TWO_BY_TWO = ClusterParams(base="0.5.23", prefills=2, decodes=2, prefill_limits=(600, 2048), prefill_port=30000)


def test_the_first_server_of_a_role_keeps_the_bare_name_the_others_are_numbered():
    assert server_names("prefill", 3) == ["prefill", "prefill-1", "prefill-2"]
    assert server_names("decode", 1) == ["decode"]
    assert [role_of(n) for n in ("prefill", "prefill-2", "decode-1")] == ["prefill", "prefill", "decode"]
    with pytest.raises(ValueError, match="names no server"):
        role_of("lb-smg")


def test_each_prefill_gets_its_own_limit_and_only_the_first_server_the_port_asked_for():
    specs = TWO_BY_TWO.specs()
    # the smaller prefill's context is its pool (a hardened prefill starts); the other keeps the cluster's
    assert [(s.name, s.role, s.pool_tokens, s.context_length, s.port) for s in specs] == [
        ("prefill", "prefill", 600, 600, 30000), ("prefill-1", "prefill", 2048, 1024, 0),
        ("decode", "decode", 4096, 1024, 0), ("decode-1", "decode", 4096, 1024, 0)]


def test_a_prefill_given_a_context_runs_it_over_its_pool():
    specs = ClusterParams(base="0.5.23", prefills=2, prefill_pool_tokens=1024, prefill_contexts=(1024, 512)).specs()
    assert [(s.pool_tokens, s.context_length) for s in specs if s.role == "prefill"] == [(1024, 1024), (1024, 512)]


def test_without_limits_every_prefill_runs_the_shared_pool_and_context():
    # the incident's layout (a pool below the context) stays expressible on every prefill
    specs = ClusterParams(base="0.5.23", prefills=3, decode_context_length=2048).specs()
    assert {(s.pool_tokens, s.context_length) for s in specs if s.role == "prefill"} == {(256, 1024)}
    assert {s.context_length for s in specs if s.role == "decode"} == {2048}


@pytest.mark.parametrize("params, words", [
    (dict(prefills=0), "at least one server per role"), (dict(decodes=0), "at least one server per role"),
    (dict(prefills=2, prefill_limits=(256,)), "one positive pool size per prefill"),
    (dict(prefills=2, prefill_limits=(256, 0)), "one positive pool size per prefill"),
    (dict(prefills=2, prefill_contexts=(512,)), "one positive length per prefill")])
def test_a_replica_layout_that_cannot_run_is_refused(params, words):
    with pytest.raises(SandboxError, match=words):
        ClusterParams(base="0.5.23", **params).validate()


def _cluster(tmp_path: Path, params: ClusterParams = TWO_BY_TWO) -> Cluster:
    """A 2x2 cluster's record as a start leaves it (nothing runs: its pids are 0)."""
    c = Cluster(params, "r", tmp_path, envs={s.name: SandboxEnv("0.5.23", tmp_path / "python", ()) for s in params.specs()})
    for port, spec in enumerate(params.specs(), 31000):
        c.procs[spec.name] = Proc(spec.name, 0, str(tmp_path / f"{spec.name}.log"), f"http://127.0.0.1:{port}", port)
    c.bootstrap_ports = {name: port for port, name in enumerate(c.servers("prefill"), 32000)}
    return c


@pytest.mark.parametrize("kind", LBS)
def test_every_load_balancer_is_started_with_every_prefill_and_every_decode(tmp_path, monkeypatch, kind):
    c = _cluster(tmp_path)
    monkeypatch.setattr(sbc, "spawn", lambda name, cmd, env, run_dir: (0, ""))  # the command, not a process
    sbc._start_lb(c, c.envs["decode"], kind, "lb", 8000)
    cmd = c.procs["lb"].cmd
    prefills = [cmd[i + 1:i + (2 if kind == "hardened" else 3)] for i, a in enumerate(cmd) if a == "--prefill"]
    wanted = [[f"http://127.0.0.1:{p}", str(b)] for p, b in ((31000, 32000), (31001, 32001))]
    assert prefills == ([[",".join(w)] for w in wanted] if kind == "hardened" else wanted)
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--decode"] == ["http://127.0.0.1:31002", "http://127.0.0.1:31003"]


def test_our_lb_parses_the_command_the_sandbox_gives_it(tmp_path, monkeypatch):
    c = _cluster(tmp_path)
    monkeypatch.setattr(sbc, "spawn", lambda name, cmd, env, run_dir: (0, ""))
    sbc._start_lb(c, c.envs["decode"], "hardened", "lb", 8000)
    args = c.procs["lb"].cmd[c.procs["lb"].cmd.index("lb") + 1:]
    ctx = lb.make_context("lb", args)
    assert len(ctx.params["prefill"]) == 2 and len(ctx.params["decode"]) == 2


def test_the_record_keeps_every_server_and_bootstrap_port(tmp_path):
    c = _cluster(tmp_path)
    again = Cluster.from_json(json.loads(json.dumps(c.to_json())))
    assert again.params == c.params and again.bootstrap_ports == c.bootstrap_ports
    assert again.bootstrap_port == 32000 and again.servers("decode") == ["decode", "decode-1"]


def test_status_json_lists_every_server(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE.name, str(tmp_path))
    (tmp_path / "sandbox").mkdir()
    (tmp_path / "sandbox" / "two.json").write_text(json.dumps(_cluster(tmp_path).to_json()))
    result = CliRunner().invoke(sandbox, ["status", "--name", "two", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)  # the line for a person went to stderr
    assert info["servers"] == {"prefill": ["prefill", "prefill-1"], "decode": ["decode", "decode-1"]}
    assert set(info["urls"]) == {"prefill", "prefill-1", "decode", "decode-1"}
    assert info["bootstrap_ports"] == {"prefill": 32000, "prefill-1": 32001} and not info["running"]
