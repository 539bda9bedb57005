"""Runs last (file order): the harness left no process and no port behind."""

from __future__ import annotations

import pytest

from sglang_hardened.sandbox.cluster import marked_pids, port_in_use

from .conftest import PORTS_USED

pytestmark = pytest.mark.e2e


def test_no_harness_process_or_port_left():
    assert not marked_pids(), "processes started by the harness are still alive"
    held = [p for p in PORTS_USED if port_in_use(p)]
    assert not held, f"ports still held after teardown: {held}"
