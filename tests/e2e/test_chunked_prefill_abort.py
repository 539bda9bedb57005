"""H5 on prefill: an abort during chunked prefill must not free the pages an earlier chunk's
write still reads.

Upstream (--disable-radix-cache): `process_pending_chunked_abort` releases every page the
request holds at once, and the next tenant's prompt is given them while the write
reads them; 0013's hold sits in the inflight queue, which the request never reaches.
Hardened: the release waits until the write returns (`source_hold.release_when_sent`),
nothing leaks, and upstream's idle memory check does not fire. With the radix cache on (the
default) the written chunk's pages stay in the tree after the abort, so it is off here.
CI runs the core pairs, the full matrix every base on Mooncake and NIXL (docs/fault-matrix.md).
"""
from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest

from sglang_hardened.sandbox.ledger import Ledger, ledger_env, wait_for, writer

from .conftest import launch, sandbox_env
from .scenarios import (FULL_MATRIX, SAFE_PARAMS, bootstrap_fields, core, post, prompt_of, upstream_only,
                        wait_pages_idle)

pytestmark = pytest.mark.e2e
PAGE_HUNGRY = "value secret tenant " * 313  # 940 tokens: needs the aborted request's pages
LONG = prompt_of(600)  # about 19 chunks of 32 tokens: the abort lands while prefill still chunks
SLOW_S = 6


# Upstream releases the aborted request's pages on every base: CI shows it on 0.5.23, and the
# hardened build there (0.5.19's source hold on an abort is the fault matrix's prefill abort).
CASES = [(*pair, False) for pair in upstream_only([("0.5.23", "mooncake")])] + \
    [(*pair, True) for pair in (core() if FULL_MATRIX else [("0.5.23", "mooncake")])]


@pytest.mark.parametrize("base, backend, hardened", CASES,
                         ids=[f"{b}-{k}-{'hardened' if h else 'upstream'}" for b, k, h in CASES])
def test_abort_during_chunked_prefill_keeps_the_pages_a_write_reads(base, backend, hardened, tmp_path):
    folder = tmp_path / "ledger"
    folder.mkdir()
    switch = tmp_path / "slow"
    cluster = launch(sandbox_env(base, hardened=hardened), backend=backend,
                     **dict(SAFE_PARAMS, decode_pool_tokens=2600, chunked_prefill_size=32,
                            extra_flags=("--disable-radix-cache",)),
                     extra_env=(*ledger_env(folder, SLOW_S),
                                f"{writer.SLOW_SWITCH_ENV}={switch}",
                                "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT=8"))
    try:
        idle = cluster.used_tokens()
        rid = uuid.uuid4().hex
        body = {"text": LONG, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}, "rid": rid,
                **bootstrap_fields(cluster)}
        switch.touch()
        sent = time.monotonic()
        post(cluster.prefill_url, body), post(cluster.decode_url, body)
        room = wait_for(folder, "begin", writer.SLOW_MIN_PAGES, after=sent)["room"]
        switch.unlink()
        abort = urllib.request.Request(f"{cluster.procs['prefill'].url}/abort_request",
                                       data=json.dumps({"rid": rid}).encode(),
                                       headers={"content-type": "application/json"})
        urllib.request.urlopen(abort, timeout=30).close()
        assert cluster.generate(PAGE_HUNGRY, max_new_tokens=1, timeout=60).status == 200
        wait_for(folder, "end", timeout_s=SLOW_S + 30, after=sent)
        unsafe = [u for u in Ledger(folder).unsafe_source_frees() if u.room == room]
        build = "hardened" if hardened else "upstream"
        print(f"\n{base} {backend} {build}: {len(unsafe)} prefill pages freed under the write")
        assert wait_pages_idle(cluster, idle) == idle, "pages leaked"
        assert "memory leak detected" not in cluster.log_tail("prefill", 400)
        if hardened:
            assert not unsafe, "\n".join(map(str, unsafe[:5]))
        else:
            assert unsafe
    finally:
        cluster.stop()
