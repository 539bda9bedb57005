"""The suite's budget guard (tests/budget.toml): a whole-suite run over any line fails, naming it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from tests.budget import STARTED_ENV, load_budget, overruns
from tests.conftest import REPO


def test_the_budget_file_has_every_line_and_a_run_within_it_passes():
    budget = load_budget()
    assert budget.setup_seconds < budget.run_seconds <= 3600, "a cold run must fit in 60 minutes"
    assert overruns(budget, budget) == []


def test_each_line_over_budget_is_named():
    budget = load_budget()
    over = replace(budget, cluster_starts=budget.cluster_starts + 1, run_seconds=budget.run_seconds * 2)
    lines = overruns(over, budget)
    assert len(lines) == 2
    assert lines[0].startswith("run_seconds: ") and lines[1].startswith("cluster_starts: ")


def test_a_budget_file_missing_a_line_is_refused(tmp_path):
    short = tmp_path / "budget.toml"
    short.write_text("run_seconds = 1\nsetup_seconds = 1\ncluster_starts = 1\n")
    with pytest.raises(ValueError, match="server_restarts"):
        load_budget(short)


def test_a_whole_suite_run_past_its_time_fails_loudly():
    """The guard in the suite's own summary, on a real pytest run that scripts/test 'started' an
    hour and a half ago: green tests, red run."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_unidiff.py"],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, STARTED_ENV: str(time.time() - 5400)})
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert "OVER BUDGET run_seconds: " in done.stdout and " passed" in done.stdout, done.stdout


def test_a_run_pytest_starts_alone_is_not_held_to_the_budget():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_unidiff.py"],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != STARTED_ENV})
    assert done.returncode == 0 and "budget (tests/budget.toml)" not in done.stdout, done.stdout


def test_the_leftovers_check_names_a_marked_process_and_a_held_port():
    """What the e2e session's end checks (tests/e2e/conftest.py) once every cluster is torn down."""
    import socket
    import uuid

    from sglang_hardened.sandbox.cluster import MARKER, leftovers

    run_id = uuid.uuid4().hex
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, MARKER: run_id})
    try:
        assert leftovers([port], run_id) == [f"process {child.pid}", f"port {port}"]
    finally:
        child.kill()
        child.wait()
        held.close()
    assert leftovers([port], run_id) == []
