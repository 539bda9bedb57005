"""The rebase job on the real upstream wheels: verdicts that match what upstream changed."""

from __future__ import annotations

import shutil

import pytest

from sglang_hardened.pipeline.build import build
from sglang_hardened.pipeline.lock import load_lock
from sglang_hardened.pipeline.rebase import CONFLICT, MERGED, OFFSET, UPSTREAM, rebase, write_series
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.pipeline.verify import verify_base

H0 = "0001-h0-report-hardened-identity.patch"
H7 = "0002-h7-refuse-kv-pool-smaller-than-context.patch"
H7B = "0003-h7-refuse-decode-input-limit-above-prefill.patch"
# The backport of upstream's admission-time rejection (sgl-project/sglang#38935, 0.5.21).
H1 = "0004-h1-reject-intake-aborted-requests-at-admission.patch"
H2 = "0005-h2-no-success-over-pending-abort.patch"
H3 = "0006-h3-refuse-decode-over-unwritten-pages.patch"
H4 = "0007-h4-end-request-on-decode-when-prefill-ends-it.patch"
# The backport of 0.5.21's deferred-release default and drain-ack fixes (0.5.19, 0.5.20).
H5 = "0008-h5-backport-deferred-release-default-on.patch"
# H5's own seam: past the release timeout, hold the pages while prefill may still write.
H5G = "0012-h5-hold-pages-while-prefill-may-write.patch"
# H5 on prefill: a failed request keeps its source pages while the transfer reads them.
H5S = "0013-h5-hold-prefill-pages-while-sent.patch"
H8 = "0010-h8-page-ownership-tags.patch"
H8N = "0011-h8-page-tags-nixl.patch"
H6B = "0020-h6-backport-mooncake-transfer-batch-indices.patch"
H6 = "0021-h6-bound-mooncake-transfer-calls.patch"
# The backport of 0.5.23's failed-session probe default (one environ.py line).
H6P = "0022-h6-backport-failed-session-probe-default-on.patch"
# H5/H6 on NIXL: a bounded wait, and the drain ack held until the writes given up on settle.
H5D = "0023-h5-nixl-drain-ack-after-writes-settle.patch"
# The backport of 0.5.23's rejected-post rule (0.5.20-0.5.22), on top of 0023's import.
H5R = "0024-h5-backport-nixl-rejected-post.patch"
# H11: parallel sampling (n > 1) refused in PD, seamed where the tokenizer manager expands the samples.
H11 = "0030-h11-refuse-parallel-sampling-in-pd.patch"
# H12 (0.5.19-0.5.21): sampling parameters that do not build refused with 400, in the same file.
H12 = "0031-h12-refuse-sampling-params-that-do-not-build.patch"
# H13: the metadata gate's hold bounded, seamed in the gate and imported just above it.
H13 = "0032-h13-end-transfer-whose-metadata-never-lands.patch"
# H5 across ranks (0.5.19-0.5.22): decode's failure hold and release loop, as each release shapes them.
H5A = "0033-h5-hold-and-release-together-across-ranks.patch"
# H14 and H15 (2026-12-06): each base's copy made by hand from its own upstream file; their imports
# sit where releases keep adding imports, H15's matches beside abort paths each release rewrote.
H14 = "0040-h14-authenticate-bootstrap-registrations.patch"
H15 = "0041-h15-abort-only-the-named-request.patch"
# H1's kind of refusal counted (the tokenizer's context-length check): both calls of the tokenizer's check wrapped; 0.5.22 put its
# watermark-request check right below the seam's import, so from there a human carries it.
H1C = "0042-h1-count-context-length-refusals.patch"


# Why each verdict is the fact: 0.5.20 moved the seam's lines (offset only);
# 0.5.21 added `"frontend"` beside the line H0 inserts before (a clean 3-way
# merge); 0.5.22 rewrote the /server_info dict (redact_watermark_secrets), so
# H0 needs a human there, as it got one in 0.5.22's own series. H7's scheduler
# context only moved; its bootstrap seams sit beside lines upstream changed
# from 0.5.20 on (a clean 3-way merge). H1 backports 0.5.21's change: a 3-way
# merge onto 0.5.20, already upstream from 0.5.21 on. H2's line gained a
# neighbour in 0.5.22 (routed experts): a human made that base's variant.
# H3's and H4's seams sit beside lines upstream keeps changing (3-way merges).
# H6's backport is upstream's own split (0.5.20 on); the engine wrapper H6
# seams gained an import line; the chunk-stop seams' import sits below the runtime_context
# import, which 0.5.23 grew (a 3-way merge there). H5's backport is 0.5.21's own code (0.5.20 changed a
# line beside its failure-path hunk: a 3-way merge); 0.5.22 reworked the drain ack
# (generation numbers), so a human confirms it is upstream there. H5's guard seam sits in
# the deadline check, beside lines the backport and each release touch (3-way merges);
# 0.5.22 moved its import's neighbours and 0.5.23 rewrote the check itself: a human.
# H5's prefill seam on the chunked-abort release sits below lines 0.5.20 rewrote
# (`_release_aborted_request`): a human, who also seams the aborted release 0.5.20 added
# (`_retire_aborted_prefill_result`), as 0.5.20's own series does: no base carries clean.
# The probe default's line only moves until 0.5.23 ships it. The NIXL drain seams are
# per-base variants: 0.5.19 waits on handles inline (0.5.20 made that `_await_handles`), and
# which ack paths bypass `_maybe_ack_drained_abort` changed in 0.5.21 and 0.5.22: a human.
# H11's import sits above a helper 0.5.22 put a watermark check before (a clean 3-way merge);
# H12's block ends where 0.5.22 added that check after `verify` (a human: 0.5.22's schema gate
# makes H12 needless there). H13's gate only moves until 0.5.23 put a new function after it
# (a clean 3-way merge). H5's rank agreement seams the failure hold, whose condition 0008
# and each release word differently, and the release loop each release rewrote: a human
# (who drops it on 0.5.23, which all-reduces both itself).
@pytest.mark.parametrize("target, verdict, h1, h2, h5, h5g, h11, h12, h13", [
    ("0.5.20", OFFSET, MERGED, MERGED, MERGED, MERGED, OFFSET, OFFSET, OFFSET),
    ("0.5.21", MERGED, UPSTREAM, MERGED, UPSTREAM, MERGED, OFFSET, OFFSET, OFFSET),
    ("0.5.22", CONFLICT, UPSTREAM, CONFLICT, CONFLICT, CONFLICT, MERGED, CONFLICT, OFFSET),
    ("0.5.23", CONFLICT, UPSTREAM, CONFLICT, CONFLICT, CONFLICT, MERGED, CONFLICT, MERGED)])
def test_series_carried_from_0_5_19(patches, tree_copy, drop_base, drop_ids, target, verdict, h1, h2, h5, h5g,
                                    h11, h12, h13):
    drop_base(target)
    drop_ids("0.5.19", "H8")  # per-base variants: tests below and test_h8_* say what it needs
    result = rebase(tree_copy, "0.5.19", target)
    assert {v.patch.name: v.verdict for v in result.verdicts} == {
        H0: verdict, H7: OFFSET, H7B: MERGED, H1: h1, H2: h2, H3: MERGED, H4: MERGED, H5: h5,
        H5G: h5g, H5S: CONFLICT, H6B: UPSTREAM, H6: MERGED if target == "0.5.23" else OFFSET,
        H6P: UPSTREAM if target == "0.5.23" else OFFSET,
        H5D: CONFLICT, H11: h11, H12: h12, H13: h13, H5A: CONFLICT,
        H14: OFFSET if target == "0.5.20" else CONFLICT, H15: CONFLICT,
        H1C: OFFSET if target in ("0.5.20", "0.5.21") else CONFLICT}
    assert result.pin == load_lock(patches)[target]  # pinned afresh: what the index serves
    if verdict == CONFLICT:
        merged = result.verdicts[0].rejects["sglang/srt/entrypoints/http_server.py"]
        assert "<<<<<<< new upstream" in merged and "hardened_identity.server_info()" in merged
    [rejected] = [v for v in result.verdicts if v.patch.name == H5S]
    assert "hardened_source_hold.release_when_sent(" in rejected.rejects["sglang/srt/managers/scheduler.py"]
    assert not result.clean


def added_lines(diff: str) -> list[str]:
    return [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")
            and line.strip("+ ")]


def test_backport_upstream_already_has_is_dropped_and_recorded(patches, tree_copy, drop_ids, drop_patches,
                                                               tmp_path):
    """0.5.20's H1 and H5 backports are 'already upstream' on 0.5.21: dropped and recorded; the
    rest carries, adds what 0.5.21's own series adds, verifies and builds."""
    shutil.rmtree(tree_copy / "0.5.21")
    drop_ids("0.5.20", "H8")
    drop_patches("0.5.20", H5D, H5R, H5A, H14, H15)  # per-base variants (above), and what builds on them
    result = rebase(tree_copy, "0.5.20", "0.5.21")
    assert {v.patch.name: v.verdict for v in result.verdicts} == {
        H0: MERGED, H7: OFFSET, H7B: OFFSET, H1: UPSTREAM, H2: OFFSET, H3: MERGED, H4: MERGED, H5: UPSTREAM,
        H5G: MERGED, H5S: MERGED, H6: OFFSET, H6P: OFFSET, H11: OFFSET, H12: OFFSET, H13: OFFSET, H1C: OFFSET}
    written = write_series(tree_copy, result, force=False)
    series_text = (written / "series").read_text()
    assert f"# dropped {H1}: Applied-Upstream: 0.5.21" in series_text
    assert f"# dropped {H5}: Applied-Upstream: 0.5.21" in series_text
    assert not (written / H1).exists() and not (written / H5).exists()
    carried = load_series(tree_copy, "0.5.21")
    assert [p.name for p in carried.patches] == [H0, H7, H7B, H2, H3, H4, H5G, H5S, H6, H6P, H11, H12, H13, H1C]
    hand_made = [p for p in load_series(patches, "0.5.21").patches
                 if p.name not in (H8, H8N, H5D, H5R, H5A, H14, H15)]
    assert [added_lines(p.diff) for p in carried.patches] == [added_lines(p.diff) for p in hand_made]
    assert load_lock(tree_copy)["0.5.21"] == result.pin
    assert all(row.ok for row in verify_base(tree_copy, "0.5.21"))
    [wheel], _ = build(["0.5.21"], tmp_path / "out", patches=tree_copy)
    assert wheel.version == "0.5.21+hardened.1" and (written / H0).is_file()


def test_h8_needs_a_human_where_upstream_refactored_the_receivers(tree_copy):
    """0.5.23 moved the Mooncake and NIXL receivers' bootstrap messages into their managers:
    H8's seams there conflict, and it rewrote the deferred-release deadline check H5's guard
    sits in, and all-reduces the holds and releases 0033 shares (the rest of 0.5.22's series
    carries); the job says so."""
    shutil.rmtree(tree_copy / "0.5.23")
    result = rebase(tree_copy, "0.5.22", "0.5.23")
    conflicts = [v for v in result.verdicts if v.verdict == CONFLICT]
    assert [v.patch.name for v in conflicts] == [H8, H8N, H5G, H5A]
    assert "sglang/srt/disaggregation/mooncake/conn.py" in conflicts[0].rejects
    assert "sglang/srt/disaggregation/nixl/conn.py" in conflicts[1].rejects
    assert not result.clean


def test_conflict_exits_non_zero_writes_the_merge_and_nothing_else(run_cli, tree_copy, tmp_path):
    shutil.rmtree(tree_copy / "0.5.23")
    lock_before = (tree_copy / "upstream.lock").read_text()
    rejects = tmp_path / "rejects"
    done = run_cli("rebase", "--from", "0.5.19", "--to", "0.5.23", "--rejects", str(rejects))
    assert done.returncode == 1
    assert "conflict" in done.stdout and "needs a human" in done.stderr
    assert not (tree_copy / "0.5.23").exists()
    assert (tree_copy / "upstream.lock").read_text() == lock_before
    rejected = sorted(rejects.iterdir())
    assert {r.name.split(".", 1)[0] for r in rejected} == {
        p.removesuffix(".patch") for p in (H0, H2, H5, H8, H8N, H5G, H5S, H5D, H12, H5A, H14, H15, H1C)}
    assert all("<<<<<<<" in r.read_text() for r in rejected)


def test_existing_series_is_not_overwritten_without_force(run_cli, tree_copy, drop_ids, drop_patches):
    drop_ids("0.5.20", "H8")  # a clean rebase: see test_backport_upstream_already_has_is_dropped_and_recorded
    drop_patches("0.5.20", H5D, H5R, H5A, H14, H15)
    before = (tree_copy / "0.5.21" / H0).read_text()
    done = run_cli("rebase", "--from", "0.5.20", "--to", "0.5.21")
    assert done.returncode == 1 and "pass --force" in done.stderr
    assert (tree_copy / "0.5.21" / H0).read_text() == before
    forced = run_cli("rebase", "--from", "0.5.20", "--to", "0.5.21", "--force")
    assert forced.returncode == 0, forced.stderr
