"""H8's switch: on unless a server is started with it off; anything else is an error naming it;
a manager started with it off makes no tag buffer (so it stamps and checks nothing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_hardened.runtime import page_tags_seams
from sglang_hardened.runtime.page_tags_seams import make_tags
from sglang_hardened.runtime.page_tags_switch import TAGS_ENV, tags_on


def test_on_unless_off():
    assert tags_on({}) and tags_on({TAGS_ENV: "on"}) and tags_on({TAGS_ENV: " ON "})
    assert not tags_on({TAGS_ENV: "off"})


@pytest.mark.parametrize("value", ["0", "false", "no", ""])
def test_anything_else_is_an_error_that_names_the_variable(value):
    with pytest.raises(ValueError, match=f"{TAGS_ENV}=.*use on or off"):
        tags_on({TAGS_ENV: value})


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_manager_started_with_tags_off_has_none_and_says_so(monkeypatch, caplog, mode):
    monkeypatch.setenv(TAGS_ENV, "off")
    manager = SimpleNamespace(kv_args=SimpleNamespace(kv_item_lens=[64], kv_data_lens=[64 * 8], gpu_id=0, total_kv_head_num=2),
                              is_mla_backend=False, attn_tp_size=1, disaggregation_mode=SimpleNamespace(value=mode), hardened_tags="stale")
    assert make_tags(manager) is None and manager.hardened_tags is None
    assert f"page tags OFF on this {mode}" in caplog.text
    monkeypatch.setenv(TAGS_ENV, "on")
    monkeypatch.setattr(page_tags_seams, "send_lanes", lambda: 4)  # upstream's setting; no sglang here
    assert make_tags(manager) is not None and manager.hardened_tags is not None
