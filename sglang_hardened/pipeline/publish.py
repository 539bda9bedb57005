"""What the weekly rebase job tells the maintainers, on GitHub, as one of them would.

A clean carry becomes a branch and one pull request per release, whose description is the
job's report; a release that needs a human becomes one issue (opened, or updated while it
stays open) with the verdict table and each conflicting file's three-way merge. For every
patch that stands in for upstream work (a ``Bug:`` pull request), the report says whether
that pull request is merged and whether the new release contains it, so a maintainer knows
which patch to drop. ``gh`` and ``git`` do the talking; ``run`` is how they are called.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import HardenedError
from .series import load_series

Run = Callable[[Sequence[str]], str]  # a command's argv -> its stdout; raises on failure

PR_URL = re.compile(r"https://github\.com/([\w.-]+/[\w.-]+)/pull/(\d+)")
BRANCH_PREFIX = "upstream-rebase/"
ISSUE_TITLE = "upstream-rebase: a new SGLang release needs a human"
BODY_MAX_CHARS = 60_000  # GitHub refuses a body over 65,536 characters
CONTAINED = ("behind", "identical")  # GitHub's compare status when the release has the commit


def run_command(argv: Sequence[str]) -> str:
    """Run a command; its stdout, or a HardenedError naming it and what it printed."""
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise HardenedError(f"`{' '.join(argv[:3])} …` failed ({done.returncode}): "
                            f"{(done.stderr or done.stdout).strip()[-500:]}")
    return done.stdout


@dataclass(frozen=True)
class UpstreamPr:
    """A patch and the upstream pull request it stands in for (its ``Bug:`` header)."""

    patch: str
    hardening_id: str
    repo: str
    number: int


def upstream_prs(patches: Path, base: str) -> list[UpstreamPr]:
    """The pull requests ``base``'s patches name in ``Bug:``."""
    found = []
    for p in load_series(patches, base).patches:
        if match := PR_URL.search(p.headers.get("Bug", "")):
            found.append(UpstreamPr(p.name, p.hardening_id, match.group(1), int(match.group(2))))
    return found


def pr_state(pr: UpstreamPr, release: str, run: Run) -> tuple[str, str]:
    """(the pull request's state, whether release ``v<release>`` contains its merge commit)."""
    view = json.loads(run(["gh", "pr", "view", str(pr.number), "--repo", pr.repo,
                           "--json", "state,mergeCommit"]))
    if view.get("state") != "MERGED" or not view.get("mergeCommit"):
        return view.get("state", "?").lower(), "no"
    status = run(["gh", "api", f"repos/{pr.repo}/compare/v{release}...{view['mergeCommit']['oid']}",
                  "--jq", ".status"]).strip()
    return "merged", "yes: drop the patch" if status in CONTAINED else "no"


def pr_table(prs: list[UpstreamPr], release: str, run: Run) -> str:
    """Markdown: each patch standing in for upstream work, and whether ``release`` has that work."""
    if not prs:
        return ""
    rows = [f"| {pr.patch} | {pr.hardening_id} | [{pr.repo}#{pr.number}](https://github.com/{pr.repo}/pull/"
            f"{pr.number}) | {' | '.join(pr_state(pr, release, run))} |" for pr in prs]
    return (f"### Upstream pull requests the patches stand in for, against {release}\n\n"
            f"| patch | id | pull request | state | in {release} |\n|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")


def _body(report: str, rejects: list[Path] = ()) -> str:
    """The report, then each conflict's merge folded; cut to what GitHub takes."""
    parts = [report] + [f"<details><summary>{path.name}</summary>\n\n```diff\n{path.read_text()}\n```\n</details>\n"
                        for path in rejects]
    body = "\n".join(parts)
    note = "\n\n(cut here: the run's rebase-report artifact has the rest)\n"
    return body if len(body) <= BODY_MAX_CHARS else body[:BODY_MAX_CHARS - len(note)] + note


def _with_body_file(body: str, argv: list[str], run: Run) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".md") as f:
        f.write(body)
        f.flush()
        return run([*argv, "--body-file", f.name])


def publish_carried(release: str, report: str, patches: Path, run: Run) -> str:
    """Push the carried series on ``upstream-rebase/<release>`` and open (or update) its pull
    request with the report; what was done, in a line."""
    branch = f"{BRANCH_PREFIX}{release}"
    title = f"Carry the patch series onto SGLang {release}"
    run(["git", "switch", "-C", branch])
    run(["git", "add", "--", str(patches)])
    run(["git", "commit", "-m", f"{title}\n\nsglang-hardened rebase, from the weekly upstream-rebase job."])
    run(["git", "push", "--force", "origin", branch])
    found = run(["gh", "pr", "list", "--head", branch, "--state", "open", "--json", "number",
                 "--jq", ".[0].number // empty"]).strip()
    if found:
        _with_body_file(_body(report), ["gh", "pr", "edit", found, "--title", title], run)
        return f"updated pull request #{found} from {branch}"
    _with_body_file(_body(report), ["gh", "pr", "create", "--head", branch, "--title", title], run)
    return f"opened a pull request from {branch}"


def publish_needs_human(release: str, report: str, rejects: Path, run: Run) -> str:
    """Open the job's one issue, or update it while it is open, with the report and the merges."""
    merges = sorted(rejects.glob("*.rej")) if rejects.is_dir() else []
    body = _body(f"SGLang {release} needs a human.\n\n{report}", merges)
    found = run(["gh", "issue", "list", "--state", "open", "--search", f'"{ISSUE_TITLE}" in:title',
                 "--json", "number", "--jq", ".[0].number // empty"]).strip()
    if found:
        _with_body_file(body, ["gh", "issue", "edit", found, "--title", ISSUE_TITLE], run)
        return f"updated issue #{found}"
    _with_body_file(body, ["gh", "issue", "create", "--title", ISSUE_TITLE], run)
    return "opened an issue"
