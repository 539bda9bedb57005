"""H8's switch: on unless a server is started with it off; anything else is an error naming it;
a manager started with it off makes no tag buffer (so it stamps and checks nothing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_hardened.common.knobs import PAGE_TAGS
from sglang_hardened.runtime.page_tags import seams as page_tags_seams
from sglang_hardened.runtime.page_tags.seams import make_tags
from sglang_hardened.runtime.page_tags.switch import tags_on


def test_on_unless_off():
    assert tags_on({}) and tags_on({PAGE_TAGS.name: "on"}) and tags_on({PAGE_TAGS.name: " ON "})
    assert not tags_on({PAGE_TAGS.name: "off"})


@pytest.mark.parametrize("value", ["0", "false", "no", ""])
def test_anything_else_is_an_error_that_names_the_variable(value):
    with pytest.raises(ValueError, match=f"{PAGE_TAGS.name}=.*use on or off"):
        tags_on({PAGE_TAGS.name: value})


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_manager_started_with_tags_off_has_none_and_says_so(monkeypatch, caplog, mode):
    monkeypatch.setenv(PAGE_TAGS.name, "off")
    manager = SimpleNamespace(kv_args=SimpleNamespace(kv_item_lens=[64], kv_data_lens=[64 * 8], gpu_id=0, total_kv_head_num=2),
                              is_mla_backend=False, attn_tp_size=1, disaggregation_mode=SimpleNamespace(value=mode), hardened_tags="stale")
    assert make_tags(manager) is None and manager.hardened_tags is None
    assert f"page tags OFF on this {mode}" in caplog.text
    monkeypatch.setenv(PAGE_TAGS.name, "on")
    monkeypatch.setattr(page_tags_seams, "send_lanes", lambda: 4)  # upstream's setting; no sglang here
    assert make_tags(manager) is not None and manager.hardened_tags is not None
