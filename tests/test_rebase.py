"""The rebase job on the real upstream wheels: verdicts that match what upstream changed."""

from __future__ import annotations

import shutil
import zipfile

import pytest

from sglang_hardened.build import build
from sglang_hardened.fetch import fetch_wheel
from sglang_hardened.lock import load_lock
from sglang_hardened.rebase import (APPLIES, CONFLICT, MERGED, OFFSET, UPSTREAM, make_diff, rebase,
                                     write_series)
from sglang_hardened.series import load_series
from sglang_hardened.verify import verify_base

H0 = "0001-h0-report-hardened-identity.patch"
H7 = "0002-h7-refuse-kv-pool-smaller-than-context.patch"
H7B = "0003-h7-refuse-decode-input-limit-above-prefill.patch"
H6B = "0020-h6-backport-mooncake-transfer-batch-indices.patch"
H6 = "0021-h6-bound-mooncake-transfer-calls.patch"
PREFILL = "sglang/srt/disaggregation/prefill.py"
# Upstream's admission-time rejection (sgl-project/sglang#38935, first in 0.5.21),
# exactly as 0.5.21 has it in PrefillBootstrapQueue.add.
ADMISSION_CHECK = """        # Rejected at intake: `set_finish_with_abort` left the verdict in
        # `to_finish`, which `finished()` does not read, and swapped the prompt
        # for a one-token stub. Bootstrapping it costs a handshake, a metadata
        # buffer and a forward pass before anything unwinds it.
        if is_unadmitted_reject(req):
            self.scheduler.retire_unadmitted_request(req)
            return
"""
ADD = "    def add(self, req: Req, num_kv_heads: int) -> None:\n"


# Why each verdict is the fact: 0.5.20 moved the seam's lines (offset only);
# 0.5.21 added `"frontend"` beside the line H0 inserts before (a clean 3-way
# merge); 0.5.22 rewrote the /server_info dict (redact_watermark_secrets), so
# H0 needs a human there, as it got one in 0.5.22's own series. H7's scheduler
# context only moved; its bootstrap seams sit beside lines upstream changed
# from 0.5.20 on (a clean 3-way merge).
@pytest.mark.parametrize("target, verdict", [
    ("0.5.20", OFFSET), ("0.5.21", MERGED), ("0.5.22", CONFLICT), ("0.5.23", CONFLICT)])
def test_series_carried_from_0_5_19(patches, tree_copy, drop_base, target, verdict, tmp_path):
    drop_base(target)
    result = rebase(tree_copy, "0.5.19", target)
    # H6's backport is upstream's own split (0.5.20 on); the engine wrapper H6 seams gained an import line.
    assert {v.patch.name: v.verdict for v in result.verdicts} == {
        H0: verdict, H7: OFFSET, H7B: MERGED, H6B: UPSTREAM, H6: OFFSET}
    assert result.pin == load_lock(patches)[target]  # pinned afresh: what the index serves
    if verdict == CONFLICT:
        merged = result.verdicts[0].rejects["sglang/srt/entrypoints/http_server.py"]
        assert "<<<<<<< new upstream" in merged and "hardened_identity.server_info()" in merged
        return
    written = write_series(tree_copy, result, force=False)
    carried = load_series(tree_copy, target)
    # The carried patches add what the ones hand-made for that base add.
    assert [added_lines(p.diff) for p in carried.patches] == [
        added_lines(p.diff) for p in load_series(patches, target).patches]
    assert load_lock(tree_copy)[target] == result.pin
    assert all(row.ok for row in verify_base(tree_copy, target))
    [wheel], _ = build([target], tmp_path / "out", patches=tree_copy)
    assert wheel.version == f"{target}+hardened.1" and (written / H0).is_file()


def added_lines(diff: str) -> list[str]:
    return [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")
            and line.strip("+ ")]


def test_backport_upstream_already_has_is_dropped_and_recorded(patches, tree_copy):
    """A backport of upstream's own fix onto 0.5.20 is 'already upstream' on 0.5.21."""
    with zipfile.ZipFile(fetch_wheel(load_lock(patches)["0.5.20"])) as zf:
        before = zf.read(PREFILL).decode()
    assert before.count(ADD) == 1
    after = before.replace(ADD, ADD + ADMISSION_CHECK)
    backport = tree_copy / "0.5.20" / "0002-h1-admission-rejection.patch"
    backport.write_text(
        "Description: Reject intake-rejected requests before bootstrap (test backport)\n"
        "Hardening-Id: H1\nOrigin: backport, sgl-project/sglang#38935\n"
        "Forwarded: not-needed\nLast-Update: 2026-11-30\n---\n"
        + make_diff({PREFILL: before}, {PREFILL: after}))
    with (tree_copy / "0.5.20" / "series").open("a") as fh:
        fh.write(backport.name + "\n")
    shutil.rmtree(tree_copy / "0.5.21")

    result = rebase(tree_copy, "0.5.20", "0.5.21")
    assert {v.patch.name: v.verdict for v in result.verdicts} == {
        H0: MERGED, H7: OFFSET, H7B: OFFSET, H6: APPLIES, backport.name: UPSTREAM}
    written = write_series(tree_copy, result, force=False)
    series_text = (written / "series").read_text()
    assert f"# dropped {backport.name}: Applied-Upstream: 0.5.21" in series_text
    assert not (written / backport.name).exists()
    assert [p.name for p in load_series(tree_copy, "0.5.21").patches] == [H0, H7, H7B, H6]


def test_conflict_exits_non_zero_writes_the_merge_and_nothing_else(run_cli, tree_copy, tmp_path):
    shutil.rmtree(tree_copy / "0.5.23")
    lock_before = (tree_copy / "upstream.lock").read_text()
    rejects = tmp_path / "rejects"
    done = run_cli("rebase", "--from", "0.5.19", "--to", "0.5.23", "--rejects", str(rejects))
    assert done.returncode == 1
    assert "conflict" in done.stdout and "needs a human" in done.stderr
    assert not (tree_copy / "0.5.23").exists()
    assert (tree_copy / "upstream.lock").read_text() == lock_before
    [rej] = list(rejects.iterdir())
    assert H0 in rej.name and "<<<<<<<" in rej.read_text()


def test_existing_series_is_not_overwritten_without_force(run_cli, tree_copy):
    before = (tree_copy / "0.5.20" / H0).read_text()
    done = run_cli("rebase", "--from", "0.5.19", "--to", "0.5.20")
    assert done.returncode == 1 and "pass --force" in done.stderr
    assert (tree_copy / "0.5.20" / H0).read_text() == before
    forced = run_cli("rebase", "--from", "0.5.19", "--to", "0.5.20", "--force")
    assert forced.returncode == 0, forced.stderr
