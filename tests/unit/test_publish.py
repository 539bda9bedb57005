"""What the weekly rebase job says on GitHub: the commands it would run, recorded, never sent."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from sglang_hardened.common.errors import HardenedError
from sglang_hardened.pipeline.publish import (
    BODY_MAX_CHARS,
    ISSUE_TITLE,
    UpstreamPr,
    pr_table,
    publish_carried,
    publish_needs_human,
    run_command,
    upstream_prs,
)


class Recorder:
    """Stands in for `gh` and `git`: records each argv (and a body file's text), answers
    the queries with what the test says GitHub holds."""

    def __init__(self, answers: dict[tuple[str, ...], str] | None = None):
        self.calls: list[list[str]] = []
        self.bodies: list[str] = []
        self.answers = answers or {}

    def __call__(self, argv: Sequence[str]) -> str:
        argv = list(argv)
        self.calls.append(argv)
        if "--body-file" in argv:
            self.bodies.append(Path(argv[argv.index("--body-file") + 1]).read_text())
        return next((out for prefix, out in self.answers.items() if tuple(argv[:len(prefix)]) == prefix), "")

    def verbs(self) -> list[str]:
        return [" ".join(c[:3]) for c in self.calls]


def test_a_clean_carry_is_pushed_to_its_branch_and_opens_its_pull_request(tmp_path):
    gh = Recorder()
    said = publish_carried("0.5.24", "# report\n| 0001 | H0 | applies |", tmp_path / "patches", gh)
    assert said == "opened a pull request from upstream-rebase/0.5.24"
    assert gh.verbs() == ["git switch -C", "git add --", "git commit -m", "git push --force",
                          "gh pr list", "gh pr create"]
    assert gh.calls[3][-1] == "upstream-rebase/0.5.24" and gh.calls[1][-1] == str(tmp_path / "patches")
    assert gh.calls[5][3:5] == ["--head", "upstream-rebase/0.5.24"]
    assert gh.bodies == ["# report\n| 0001 | H0 | applies |"]


def test_the_same_release_next_week_updates_the_open_pull_request(tmp_path):
    gh = Recorder({("gh", "pr", "list"): "17\n"})
    assert publish_carried("0.5.24", "report", tmp_path, gh) == "updated pull request #17 from upstream-rebase/0.5.24"
    assert gh.calls[-1][:4] == ["gh", "pr", "edit", "17"] and "create" not in gh.verbs()[-1]


def test_a_release_that_needs_a_human_opens_one_issue_with_each_merge_folded(tmp_path):
    rejects = tmp_path / "rebase-rejects" / "0.5.24"
    rejects.mkdir(parents=True)
    (rejects / "0001-h0.patch.http_server.py.rej").write_text("<<<<<<< new upstream\nx\n=======\ny\n>>>>>>> patched")
    gh = Recorder()
    assert publish_needs_human("0.5.24", "| 0001 | H0 | conflict |", rejects, gh) == "opened an issue"
    assert gh.verbs() == ["gh issue list", "gh issue create"]
    assert gh.calls[-1][3:5] == ["--title", ISSUE_TITLE]
    [body] = gh.bodies
    assert body.startswith("SGLang 0.5.24 needs a human.\n\n| 0001 | H0 | conflict |")
    assert "<summary>0001-h0.patch.http_server.py.rej</summary>" in body and "<<<<<<< new upstream" in body


def test_while_the_issue_is_open_it_is_updated_not_opened_again(tmp_path):
    gh = Recorder({("gh", "issue", "list"): "4\n"})
    assert publish_needs_human("0.5.25", "report", tmp_path / "none", gh) == "updated issue #4"
    assert gh.calls[-1][:4] == ["gh", "issue", "edit", "4"]


def test_a_body_over_github_s_limit_is_cut_saying_where_the_rest_is(tmp_path):
    gh = Recorder()
    publish_carried("0.5.24", "x" * (BODY_MAX_CHARS * 2), tmp_path, gh)
    [body] = gh.bodies
    assert len(body) <= BODY_MAX_CHARS and body.endswith("the run's rebase-report artifact has the rest)\n")


def test_each_stand_in_patch_is_looked_up_in_the_new_release():
    prs = [UpstreamPr("0030-h11.patch", "H11", "sgl-project/sglang", 30723),
           UpstreamPr("0012-h5.patch", "H5", "sgl-project/sglang", 38961),
           UpstreamPr("0022-h6.patch", "H6", "sgl-project/sglang", 25287)]
    merged = json.dumps({"state": "MERGED", "mergeCommit": {"oid": "abc123"}})
    gh = Recorder({("gh", "pr", "view", "30723"): json.dumps({"state": "CLOSED", "mergeCommit": None}),
                   ("gh", "pr", "view", "38961"): merged, ("gh", "pr", "view", "25287"): merged,
                   ("gh", "api", "repos/sgl-project/sglang/compare/v0.5.24...abc123"): "ahead\n"})
    table = pr_table(prs[:2], "0.5.24", gh)
    assert "| 0030-h11.patch | H11 | [sgl-project/sglang#30723](https://github.com/sgl-project/sglang/pull/30723) " \
           "| closed | no |" in table
    assert "| 0012-h5.patch | H5 |" in table and table.rstrip().endswith("| merged | no |")
    gh.answers[("gh", "api", "repos/sgl-project/sglang/compare/v0.5.24...abc123")] = "behind\n"
    assert pr_table(prs[2:], "0.5.24", gh).rstrip().endswith("| merged | yes: drop the patch |")
    assert pr_table([], "0.5.24", gh) == ""


def test_the_series_names_the_pull_requests_its_patches_stand_in_for(patches):
    found = {pr.patch: pr.number for pr in upstream_prs(patches, "0.5.19")}
    assert found["0030-h11-refuse-parallel-sampling-in-pd.patch"] == 30723
    assert all(pr.repo == "sgl-project/sglang" for pr in upstream_prs(patches, "0.5.19"))


def test_a_failing_command_is_named_with_what_it_printed():
    with pytest.raises(HardenedError, match=r"`sh -c echo no token.*` failed \(3\): no token$"):
        run_command(["sh", "-c", "echo no token >&2; exit 3"])
