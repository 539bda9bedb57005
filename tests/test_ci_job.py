"""The scheduled upstream-rebase job, run as CI runs it, against a real newer release."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_job_reports_a_conflict_and_asks_for_a_human(tree_copy, drop_base, tmp_path):
    # Make 0.5.22 and 0.5.23 "new": the newest supported base is then 0.5.21,
    # whose H0 does not apply to 0.5.22's rewritten /server_info.
    drop_base("0.5.23")
    drop_base("0.5.22")
    report = tmp_path / "report.md"
    done = subprocess.run(["bash", str(REPO / "ci" / "upstream-rebase"), str(report)],
                          capture_output=True, text=True, env={**os.environ, "REBASE_TEST_COMMAND": "false"}, timeout=900)
    assert done.returncode == 1, done.stdout + done.stderr
    text = report.read_text()
    assert "## 0.5.21 → 0.5.22" in text and "needs a human" in text
    assert "0.5.23" not in text  # the job stops at the first release that needs a human
    assert "| 0001-h0-report-hardened-identity.patch | H0 | conflict |" in text
    assert list((tmp_path / "rebase-rejects" / "0.5.22").iterdir())
    assert not (tree_copy / "0.5.22").exists()


def _carry_0523(drop_base, drop_ids, tmp_path: Path, test_command: str) -> tuple[subprocess.CompletedProcess, str]:
    """Run the job with 0.5.23 'new' (0.5.22's series carries onto it cleanly); its result and report."""
    drop_base("0.5.23")  # 0.5.22's H0 carries onto 0.5.23 (same /server_info shape)
    # H8 needs a human there (test_rebase.py), so does H5's release-guard seam: 0.5.23
    # rewrote the deferred-release deadline check it sits in
    drop_ids("0.5.22", "H8", "H5")
    report = tmp_path / "report.md"
    done = subprocess.run(["bash", str(REPO / "ci" / "upstream-rebase"), str(report)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "REBASE_TEST_COMMAND": test_command})
    return done, report.read_text()


def test_job_carries_a_clean_release_verifies_builds_and_tests_it(tree_copy, drop_base, drop_ids, tmp_path):
    marker = tmp_path / "tests-ran"
    done, text = _carry_0523(drop_base, drop_ids, tmp_path, f"touch {marker}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "## 0.5.22 → 0.5.23" in text and "carried, verified, built and tested" in text
    assert marker.exists()  # the test command ran: 'tested' is its verdict, not the job's word
    assert (tree_copy / "0.5.23" / "series").is_file()
    assert list((tmp_path / "dist" / "0.5.23").glob("sglang-0.5.23+hardened.1-*.whl"))


def test_job_reports_a_carried_release_whose_tests_fail_as_needing_a_human(tree_copy, drop_base, drop_ids, tmp_path):
    """The same clean carry with a failing test command: the job fails and never says 'tested'."""
    done, text = _carry_0523(drop_base, drop_ids, tmp_path, "false")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "## 0.5.22 → 0.5.23" in text and "needs a human" in text
    assert "tested" not in text
