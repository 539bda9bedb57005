"""The policy file and how `launch` applies it: a user's value always wins, and is logged."""

from __future__ import annotations

import pytest

from sglang_hardened.common.knobs import TRANSFER_LINK_RATE, TRANSFER_MAX_ENTRIES
from sglang_hardened.common.errors import HardenedError
from sglang_hardened.operations.launch import plan
from sglang_hardened.runtime.policy import knobs_for, load_policy

DEFERRED = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
CHECKSUM = "--disaggregation-enable-kv-checksum"
PD = ["--model-path", "/m", "--disaggregation-mode", "decode"]


def test_every_knob_names_a_hardening_id_and_a_reason():
    for knob in load_policy():
        assert knob.id.startswith("H") and knob.why and knob.name


def test_deferred_release_is_set_on_every_base(bases):
    for base in bases:
        launch = plan(base, PD, {})
        assert launch.env[DEFERRED] == "1"


def test_user_env_wins_and_is_reported():
    launch = plan("0.5.19", PD, {DEFERRED: "0"})
    assert launch.env[DEFERRED] == "0"
    [decision] = [d for d in launch.decisions if d.name == DEFERRED]
    assert decision.outcome == "user override (policy: 1)"


def test_pd_only_flag_added_in_pd_mode_only():
    assert CHECKSUM in plan("0.5.23", PD, {}).argv
    assert CHECKSUM not in plan("0.5.23", ["--model-path", "/m"], {}).argv
    assert CHECKSUM not in plan("0.5.22", PD, {}).argv


def test_flag_the_user_gave_is_not_added_twice():
    launch = plan("0.5.23", PD + [CHECKSUM], {})
    assert launch.argv.count(CHECKSUM) == 1
    assert any(d.outcome == "user's own flag" for d in launch.decisions)


def test_a_version_that_is_not_one_is_refused():
    with pytest.raises(HardenedError, match="not a release version"):
        knobs_for("latest")


def test_launch_dry_run_prints_the_command(run_cli):
    done = run_cli("launch", "--base", "0.5.23", "--dry-run", "--", *PD)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(f"--disaggregation-mode decode {CHECKSUM}")
    assert "set by policy" in done.stderr


def test_transfer_bounds_are_set_on_every_base_from_the_policy_limits(bases):
    for base in bases:
        env = plan(base, PD, {}).env
        # policy.yaml: 1024 pages per batch (upstream's 0 is unbounded), 1024 entries per call,
        # 125,000,000 B/s (1 Gbit/s)
        assert env["SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"] == "1024"
        assert (env[TRANSFER_MAX_ENTRIES.name], env[TRANSFER_LINK_RATE.name]) == ("1024", "125000000")


def test_policy_show_prints_the_transfer_bounds(run_cli):
    done = run_cli("policy", "show", "--base", "0.5.19")
    assert done.returncode == 0, done.stderr
    for name in ("SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES", TRANSFER_MAX_ENTRIES.name, TRANSFER_LINK_RATE.name):
        assert name in done.stdout
