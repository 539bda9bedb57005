"""The scheduled upstream-rebase job, run as CI runs it, against a real newer release."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sglang_hardened.common.knobs import UPSTREAM_RELEASES
from tests.harness import REPO

# `gh` and `git`'s publishing verbs stand in for GitHub: they record each call (and a body
# file's text) and answer as a repository with no open pull request or issue would; every
# other git command is the real one (the rebase's three-way merges).
STAND_IN = """#!{python}
import json, os, pathlib, sys
argv = sys.argv[1:]
if "{name}" == "git" and argv[:1] not in (["switch"], ["add"], ["commit"], ["push"]):
    os.execv("{git}", ["git", *argv])
record = {{"argv": ["{name}", *argv]}}
if "--body-file" in argv:
    record["body"] = pathlib.Path(argv[argv.index("--body-file") + 1]).read_text()
with open(os.environ["STAND_IN_LOG"], "a") as log:
    log.write(json.dumps(record) + "\\n")
if argv[:2] == ["pr", "view"]:
    print(json.dumps({{"state": "OPEN", "mergeCommit": None}}))
"""


@pytest.fixture(autouse=True)
def upstream_releases(monkeypatch) -> None:
    """Upstream as these tests know it, not as the index lists it today: a release after 0.5.23
    there would be carried onto next, and fail the clean carry."""
    monkeypatch.setenv(UPSTREAM_RELEASES.name, "0.5.21,0.5.22,0.5.23")
    # one wheel per carried release: the carry, not the build of every wheel (test_build.py's)
    monkeypatch.setenv("REBASE_BUILD_ARGS", "--python 3.11 --arch x86_64")


@pytest.fixture
def github(tmp_path) -> tuple[dict[str, str], Path]:
    """The job's environment with REBASE_PUBLISH on and GitHub stood in for; the calls' log."""
    bin_dir, log = tmp_path / "stand-ins", tmp_path / "github.jsonl"
    bin_dir.mkdir()
    for name in ("gh", "git"):
        (bin_dir / name).write_text(STAND_IN.format(python=shutil.which("python3"), name=name, git=shutil.which("git")))
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "STAND_IN_LOG": str(log), "REBASE_PUBLISH": "1"}, log


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_job_reports_a_conflict_and_asks_for_a_human(tree_copy, drop_base, tmp_path, github):
    # Make 0.5.22 and 0.5.23 "new": the newest supported base is then 0.5.21,
    # whose H0 does not apply to 0.5.22's rewritten /server_info.
    drop_base("0.5.23")
    drop_base("0.5.22")
    report = tmp_path / "report.md"
    env, log = github
    done = subprocess.run(["bash", str(REPO / "ci" / "upstream-rebase"), str(report)], capture_output=True, text=True,
                          env={**os.environ, **env, "REBASE_TEST_COMMAND": "false"}, timeout=900)
    assert done.returncode == 1, done.stdout + done.stderr
    text = report.read_text()
    assert "## 0.5.21 → 0.5.22" in text and "needs a human" in text
    assert "0.5.23" not in text  # the job stops at the first release that needs a human
    assert "| 0001-h0-report-hardened-identity.patch | H0 | conflict |" in text
    assert list((tmp_path / "rebase-rejects" / "0.5.22").iterdir())
    assert not (tree_copy / "0.5.22").exists()
    # the pull requests 0.5.21's patches stand in for, looked up against 0.5.22; one issue
    assert "| 0030-h11-refuse-parallel-sampling-in-pd.patch | H11 | [sgl-project/sglang#30723]" in text
    said = calls(log)
    assert [c["argv"][:3] for c in said if c["argv"][1] != "pr"] == [["gh", "issue", "list"], ["gh", "issue", "create"]]
    body = said[-1]["body"]
    assert body.startswith("SGLang 0.5.22 needs a human.") and "| 0001-h0-report-hardened-identity.patch | H0 | conflict |" in body
    assert "<summary>0001-h0-report-hardened-identity.patch." in body and "<<<<<<< new upstream" in body


def _carry_0523(drop_base, drop_ids, tmp_path: Path, test_command: str,
                env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, str]:
    """Run the job with 0.5.23 'new' (0.5.22's series carries onto it cleanly); its result and report."""
    drop_base("0.5.23")  # 0.5.22's H0 carries onto 0.5.23 (same /server_info shape)
    # H8 needs a human there (test_rebase.py), so does H5's release-guard seam: 0.5.23
    # rewrote the deferred-release deadline check it sits in
    drop_ids("0.5.22", "H8", "H5")
    report = tmp_path / "report.md"
    done = subprocess.run(["bash", str(REPO / "ci" / "upstream-rebase"), str(report)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {}), "REBASE_TEST_COMMAND": test_command})
    return done, report.read_text()


def test_job_carries_a_clean_release_verifies_builds_and_tests_it(tree_copy, drop_base, drop_ids, tmp_path, github):
    marker = tmp_path / "tests-ran"
    env, log = github
    done, text = _carry_0523(drop_base, drop_ids, tmp_path, f"touch {marker}", env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "## 0.5.22 → 0.5.23" in text and "carried, verified, built and tested" in text
    assert marker.exists()  # the test command ran: 'tested' is its verdict, not the job's word
    assert (tree_copy / "0.5.23" / "series").is_file()
    assert list((tmp_path / "dist" / "0.5.23").glob("sglang-0.5.23+hardened.1-*.whl"))
    # pushed to its branch, and its pull request opened with the report as its description
    said = [c for c in calls(log) if c["argv"][:3] != ["gh", "pr", "view"]]
    assert [c["argv"][:2] for c in said] == [["git", "switch"], ["git", "add"], ["git", "commit"], ["git", "push"],
                                             ["gh", "pr"], ["gh", "pr"]]
    assert said[1]["argv"][-1] == str(tree_copy) and said[3]["argv"][-1] == "upstream-rebase/0.5.23"
    assert said[-1]["argv"][2:5] == ["create", "--head", "upstream-rebase/0.5.23"]
    assert "carried, verified, built and tested" in said[-1]["body"]


def test_job_reports_a_carried_release_whose_tests_fail_as_needing_a_human(tree_copy, drop_base, drop_ids, tmp_path):
    """The same clean carry with a failing test command: the job fails and never says 'tested'."""
    done, text = _carry_0523(drop_base, drop_ids, tmp_path, "false")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "## 0.5.22 → 0.5.23" in text and "needs a human" in text
    assert "tested" not in text
