"""The sandbox's rank layout: what each role is started with, and the layouts it refuses."""

from __future__ import annotations

import pytest

from sglang_hardened.sandbox import cluster
from sglang_hardened.sandbox.cluster import (DP_LM_HEAD_ON_CPU, ClusterParams, child_env, cpu_flags, parallel_flags,
                                             rank_cores)
from sglang_hardened.sandbox.env import SandboxEnv, SandboxError


def test_one_rank_adds_no_flag_and_no_binding(tmp_path):
    p = ClusterParams(base="0.5.23")
    assert parallel_flags(p, "prefill") == parallel_flags(p, "decode") == []
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in child_env(SandboxEnv("0.5.23", tmp_path / "python", ()), p, "r", role="decode")


@pytest.fixture
def three_cores(monkeypatch) -> None:
    """This process may run on cores 1, 3 and 8 (a set: no order of its own)."""
    monkeypatch.setattr(cluster.os, "sched_getaffinity", lambda _pid: {8, 1, 3})


def test_each_role_gets_its_own_tp_size_and_cores(tmp_path, three_cores):
    p = ClusterParams(base="0.5.23", tp=2, decode_tp=1)
    assert parallel_flags(p, "prefill") == ["--tp-size", "2"] and parallel_flags(p, "decode") == []
    env = SandboxEnv("0.5.23", tmp_path / "python", ())
    # prefill's 2 ranks on the lowest two of cores 1, 3, 8
    assert child_env(env, p, "r", role="prefill")["SGLANG_CPU_OMP_THREADS_BIND"] == "1|3"
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in child_env(env, p, "r", role="decode")
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in child_env(env, p, "r")  # the load balancer has no ranks


def test_more_ranks_than_cores_share_them_round_robin(three_cores):
    # ranks 0-4 on cores 1, 3, 8, then again from the first: 1, 3
    assert rank_cores(5) == "1|3|8|1|3"


def test_dp_attention_splits_the_tp_ranks():
    p = ClusterParams(base="0.5.23", tp=2, dp=2)
    assert parallel_flags(p, "decode") == ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]
    # the all-to-all LM head has no CPU kernel: upstream's opt-out with DP attention, only there
    assert DP_LM_HEAD_ON_CPU[0] in cpu_flags(p, "decode")
    assert DP_LM_HEAD_ON_CPU[0] not in cpu_flags(ClusterParams(base="0.5.23", tp=2), "decode")


@pytest.mark.parametrize("layout", [dict(tp=0), dict(decode_tp=0), dict(tp=2, decode_tp=3, dp=2), dict(tp=3, dp=2)])
def test_a_layout_sglang_cannot_start_is_refused_naming_the_role(layout):
    with pytest.raises(SandboxError, match="TP size .* must be a positive multiple of the DP size"):
        ClusterParams(base="0.5.23", **layout).validate()


@pytest.mark.parametrize("dp", [0, -1])
def test_a_dp_size_below_one_is_refused_not_divided_by(dp):
    with pytest.raises(SandboxError, match=f"DP size must be at least 1, not {dp}"):
        ClusterParams(base="0.5.23", tp=2, dp=dp).validate()


def test_prefill_pp_runs_stages_on_prefill_only(tmp_path, three_cores):
    p = ClusterParams(base="0.5.23", tp=2, prefill_pp=2)
    assert parallel_flags(p, "prefill") == ["--tp-size", "2", "--pp-size", "2"]
    assert parallel_flags(p, "decode") == ["--tp-size", "2"]
    env = SandboxEnv("0.5.23", tmp_path / "python", ())
    # prefill's 4 processes (2 TP ranks x 2 stages) share the 3 cores; decode's 2 ranks the lowest two
    assert child_env(env, p, "r", role="prefill")["SGLANG_CPU_OMP_THREADS_BIND"] == "1|3|8|1"
    assert child_env(env, p, "r", role="decode")["SGLANG_CPU_OMP_THREADS_BIND"] == "1|3"
    with pytest.raises(SandboxError, match="prefill's PP size must be at least 1, not 0"):
        ClusterParams(base="0.5.23", prefill_pp=0).validate()
