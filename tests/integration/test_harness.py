"""The harness (tests/harness.py) on real pytest runs: a whole tier over any budget line, or
missing a claim's upstream-failing test or its hardened twin, fails naming it; the gate runs the
claims and leaves the other e2e tests to the full run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from sglang_hardened.common.knobs import SANDBOX, SUITE_STARTED
from tests.harness import REPO, TIERS, catalogue, load_budget, overruns


def pytest_run(*args: str | Path, started: float | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """A real pytest, with this checkout's harness; ``started``: scripts/test's start (a whole tier)."""
    env = {k: v for k, v in os.environ.items() if k != SUITE_STARTED.name}
    if started is not None:
        env[SUITE_STARTED.name] = str(started)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300, env=env)


def claimed_tests(tmp_path: Path, ids: list[str]) -> list[str]:
    """A test file outside the tree with a passing upstream and hardened test for each of ``ids``,
    run under the harness alone; returns pytest's arguments for it."""
    body = "import pytest\n" + "".join(
        f"\n@pytest.mark.claim({hid!r}, {side!r})\ndef test_{hid}_{side}():\n    assert True\n"
        for hid in ids for side in ("upstream", "hardened"))
    (tmp_path / "test_claims.py").write_text(body)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    return ["-p", "tests.harness", "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
            str(tmp_path / "test_claims.py")]


@pytest.mark.parametrize("tier", TIERS)
def test_each_tier_has_every_budget_line_and_a_run_within_it_passes(tier):
    budget = load_budget(tier)
    assert budget.setup_seconds < budget.run_seconds <= 5400, "a whole run must fit in CI's 90 minutes"
    assert overruns(budget, budget) == []
    assert load_budget("gate").run_seconds <= 1800, "the landing gate is 30 minutes"


def test_each_line_over_budget_is_named():
    budget = load_budget("gate")
    over = replace(budget, cluster_starts=budget.cluster_starts + 1, run_seconds=budget.run_seconds * 2)
    lines = overruns(over, budget)
    assert len(lines) == 2
    assert lines[0].startswith("run_seconds: ") and lines[1].startswith("cluster_starts: ")


def test_a_budget_table_missing_a_line_or_a_tier_is_refused(tmp_path):
    short = tmp_path / "budget.toml"
    short.write_text("[gate]\nrun_seconds = 1\nsetup_seconds = 1\ncluster_starts = 1\n")
    with pytest.raises(ValueError, match="server_restarts"):
        load_budget("gate", short)
    with pytest.raises(ValueError, match=r"no \[full\] table"):
        load_budget("full", short)


def test_a_whole_tier_run_past_its_time_fails_loudly(tmp_path):
    """A run that scripts/test 'started' an hour and a half ago: green tests, red run."""
    done = pytest_run("--tier", "full", *claimed_tests(tmp_path, catalogue()), started=time.time() - 5400)
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert "OVER BUDGET run_seconds: " in done.stdout and " passed" in done.stdout, done.stdout
    assert "CLAIM NOT SHOWN" not in done.stdout, done.stdout


def test_a_run_pytest_starts_alone_is_held_to_nothing():
    done = pytest_run("tests/unit/test_unidiff.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "budget (tests/budget.toml" not in done.stdout and "CLAIM NOT SHOWN" not in done.stdout, done.stdout


def test_a_claim_missing_its_hardened_twin_fails_the_run_naming_it(tmp_path):
    args = claimed_tests(tmp_path, catalogue())
    body = (tmp_path / "test_claims.py").read_text()
    (tmp_path / "test_claims.py").write_text(body.replace("@pytest.mark.claim('H7', 'hardened')\n", ""))
    done = pytest_run("--tier", "full", *args, started=time.time())
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert "CLAIM NOT SHOWN H7" in done.stdout and "CLAIM NOT SHOWN H6" not in done.stdout, done.stdout
    assert " passed" in done.stdout and "failed" not in done.stdout.split("CLAIM NOT SHOWN")[0], done.stdout


def test_a_claim_whose_test_fails_is_not_shown(tmp_path):
    args = claimed_tests(tmp_path, catalogue())
    body = (tmp_path / "test_claims.py").read_text()
    (tmp_path / "test_claims.py").write_text(body.replace("def test_H3_upstream():\n    assert True",
                                                          "def test_H3_upstream():\n    assert False"))
    done = pytest_run("--tier", "full", *args, started=time.time())
    assert done.returncode == pytest.ExitCode.TESTS_FAILED
    assert "CLAIM NOT SHOWN H3" in done.stdout, done.stdout


def test_a_claim_whose_test_passes_only_as_an_expected_failure_is_not_shown(tmp_path):
    """Review finding: a bare xfail that passed carried an empty reason and read as shown."""
    args = claimed_tests(tmp_path, catalogue())
    body = (tmp_path / "test_claims.py").read_text()
    (tmp_path / "test_claims.py").write_text(body.replace("def test_H4_hardened():", "@pytest.mark.xfail\ndef test_H4_hardened():"))
    done = pytest_run("--tier", "full", *args, started=time.time())
    assert done.returncode == pytest.ExitCode.TESTS_FAILED
    assert "CLAIM NOT SHOWN H4" in done.stdout, done.stdout


def test_every_claim_shown_within_budget_passes_with_its_table(tmp_path):
    done = pytest_run("--tier", "full", *claimed_tests(tmp_path, catalogue()), started=time.time())
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout.split("claims (patches/hardening.toml)")[1]
    assert all(f"test_{hid}_upstream" in table and f"test_{hid}_hardened" in table for hid in catalogue()), table


def test_the_gate_selects_every_claim_and_no_other_e2e_test():
    gate = pytest_run("--collect-only", "--tier", "gate", "tests/e2e").stdout.splitlines()
    full = pytest_run("--collect-only", "--tier", "full", "tests/e2e").stdout.splitlines()
    gate_ids = {line for line in gate if "::" in line}
    full_ids = {line for line in full if "::" in line}
    assert gate_ids and gate_ids < full_ids
    assert "tests/e2e/test_smg.py::test_a_hang_up_through_smg_frees_pages_under_a_write_on_upstream_0519" in full_ids - gate_ids
    assert "tests/e2e/test_fault_matrix.py::test_metadata_that_never_lands[0.5.23-mooncake-hardened]" in gate_ids
    assert "tests/e2e/test_fault_matrix.py::test_metadata_that_never_lands[0.5.19-mooncake-hardened]" not in gate_ids


def test_a_shard_runs_its_modules_and_the_shards_together_run_all():
    shards = [{line.split("::")[0] for line in pytest_run("--collect-only", "--shard", f"{k}/3", "tests/unit").stdout.splitlines()
               if "::" in line} for k in (1, 2, 3)]
    everything = {line.split("::")[0] for line in pytest_run("--collect-only", "tests/unit").stdout.splitlines() if "::" in line}
    assert all(shards) and set().union(*shards) == everything
    assert sum(map(len, shards)) == len(everything), "no module runs in two shards"


def test_the_leftovers_check_names_a_marked_process_and_a_held_port():
    """What the e2e session's end checks (tests/e2e/conftest.py) once every cluster is torn down."""
    import socket
    import uuid

    from sglang_hardened.sandbox.cluster import leftovers

    run_id = uuid.uuid4().hex
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, SANDBOX.name: run_id})
    try:
        assert leftovers([port], run_id) == [f"process {child.pid}", f"port {port}"]
    finally:
        child.kill()
        child.wait()
        held.close()
    assert leftovers([port], run_id) == []
