"""The sandbox's start: a lost race for a port it picked is told apart from a server that failed."""

from __future__ import annotations

import pytest

from sglang_hardened.sandbox.cluster import lost_port_race

UVICORN = "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 47077): address already in use"
SMG = ("RuntimeError: Failed to bind the HTTP listener on 127.0.0.1:42049: Address already in use (os error 98)")  # CI, 2026-12-05


@pytest.mark.parametrize("tail, lost", [(UVICORN, True), (SMG, True), ("RuntimeError: model not found", False)])
def test_both_servers_words_for_a_taken_port_are_a_lost_race(tail, lost):
    assert lost_port_race(f"starting\n{tail}\n") is lost
