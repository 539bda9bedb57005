"""Each vendor hardening patch applies without the others, so a test can prove the layers
behind one by leaving it out (tests/e2e: `sandbox_env(..., without=...)`)."""

from __future__ import annotations

import pytest

from sglang_hardened.common.errors import HardenedError
from sglang_hardened.pipeline.series import copy_without, load_series
from sglang_hardened.pipeline.verify import verify_base

LEFT_OUT = [("H1",), ("H2",), ("H3",), ("H4",), ("H1", "H3")]


@pytest.mark.parametrize("ids", LEFT_OUT, ids="-".join)
def test_series_applies_without(patches, bases, ids, tmp_path):
    for base in bases:
        if not set(ids) <= {p.hardening_id for p in load_series(patches, base).patches}:
            continue  # e.g. H1 on a base where upstream has it
        tree = copy_without(patches, base, ids, tmp_path / base)
        rows = verify_base(tree, base)
        assert all(row.ok for row in rows), [r for r in rows if not r.ok]
        assert not {p.hardening_id for p in load_series(tree, base).patches} & set(ids)


def test_leaving_out_an_id_the_series_lacks_is_an_error(patches, tmp_path):
    with pytest.raises(HardenedError, match="0.5.23's series has no patch for H99"):
        copy_without(patches, "0.5.23", ("H99",), tmp_path / "t")
