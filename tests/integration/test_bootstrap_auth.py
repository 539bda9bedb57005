"""H14's guard on a real aiohttp bootstrap-server stand-in: upstream's `/route` handler shape
(the table it fills), behind `bootstrap_auth.guard` as the patch installs it. The e2e twins
(tests/e2e/test_upstream_defaults.py, test_probes_safe.py) run the real servers."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from sglang_hardened.common.knobs import BOOTSTRAP_TOKEN
from sglang_hardened.runtime import bootstrap_auth

REG = {"attn_tp_rank": 0, "attn_dp_rank": 0, "attn_cp_rank": 0, "pp_rank": 0, "system_dp_rank": 0,
       "rank_ip": "10.0.0.1", "rank_port": 17000}


def _server(guarded: bool):
    """Upstream's shape: PUT /route reads fields unchecked and fills a table; GET reads it."""
    from aiohttp import web

    table: dict = {}

    async def route(request: web.Request) -> web.Response:
        if request.method == "GET":
            return web.json_response(table.get(request.query["key"]) or {}, status=200 if table else 404)
        data = await request.json()
        table[str(data["attn_tp_rank"])] = {"rank_ip": data["rank_ip"], "rank_port": int(data["rank_port"])}
        return web.Response(text="OK")

    app = web.Application()
    app.router.add_route("*", "/route", route)
    async def register_dp_rank(request: web.Request) -> web.Response:
        return web.Response(text="OK")

    app.router.add_post("/register_dp_rank", register_dp_rank)
    if guarded:
        bootstrap_auth.guard(app)
    return app, table


async def _exchange(app, calls):
    """Run ``calls`` (method, path, body, headers, source address) against ``app`` on a real socket."""
    import aiohttp
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    out = []
    try:
        for method, path, body, headers, source in calls:
            connector = aiohttp.TCPConnector(local_addr=(source, 0))
            async with aiohttp.ClientSession(connector=connector) as s:
                data = body if isinstance(body, (bytes, str)) else json.dumps(body)
                async with s.request(method, f"http://127.0.0.1:{port}{path}", data=data, headers=headers) as r:
                    out.append((r.status, await r.text()))
    finally:
        await runner.cleanup()
    return out


def run(app, *calls):
    return asyncio.run(_exchange(app, list(calls)))


def forged(port: int = 9) -> dict:
    return {**REG, "rank_port": port}


def test_upstream_shape_takes_any_registration_from_anyone():
    """What the guard is for: without it a forged PUT replaces rank 0's address."""
    app, table = _server(guarded=False)
    assert [s for s, _ in run(app, ("PUT", "/route", REG, {}, "127.0.0.1"),
                              ("PUT", "/route", forged(), {}, "127.0.0.2"))] == [200, 200]
    assert table["0"]["rank_port"] == 9


def test_with_a_token_only_the_token_registers_and_the_first_peer_keeps_its_rank(monkeypatch, caplog):
    monkeypatch.setenv(BOOTSTRAP_TOKEN.name, "s3cret")
    good = bootstrap_auth.headers()
    app, table = _server(guarded=True)
    with caplog.at_level(logging.WARNING, "sglang_hardened"):
        replies = run(app,
                      ("PUT", "/route", REG, good, "127.0.0.1"),
                      ("PUT", "/route", forged(), {}, "127.0.0.2"),
                      ("PUT", "/route", forged(), {bootstrap_auth.TOKEN_HEADER: "guess"}, "127.0.0.2"),
                      ("PUT", "/route", forged(), {}, "127.0.0.2"),
                      ("POST", "/register_dp_rank", {"bootstrap_room": 1, "dp_rank": 3}, {}, "127.0.0.2"),
                      ("PUT", "/route", forged(), good, "127.0.0.3"),
                      ("PUT", "/route", REG, good, "127.0.0.1"),
                      ("POST", "/register_dp_rank", {"bootstrap_room": 1, "dp_rank": 0}, good, "127.0.0.1"))
    assert [s for s, _ in replies] == [200, 403, 403, 403, 403, 409, 200, 200]
    assert bootstrap_auth.TOKEN_HEADER in replies[1][1] and "s3cret" not in replies[1][1]
    assert "127.0.0.1" in replies[5][1]  # names who holds the rank
    assert table["0"] == {"rank_ip": "10.0.0.1", "rank_port": 17000}
    refusals = [r.getMessage() for r in caplog.records if "H14" in r.getMessage()]
    assert len([m for m in refusals if "127.0.0.2" in m]) == 1, refusals  # once per peer


@pytest.mark.parametrize("body, says", [
    ("not json", "bad registration"),
    ([1, 2], "a JSON object"),
    ({"rank_ip": "x"}, "names its ranks"),
    ({**REG, "attn_tp_rank": "0"}, "attn_tp_rank"),
    ({**REG, "pp_rank": -1}, "pp_rank"),
    ({k: v for k, v in REG.items() if k != "rank_ip"}, "rank_ip"),  # upstream's own KeyError
    ({**REG, "rank_port": "x"}, "ValueError"),
])
def test_a_malformed_registration_gets_400_naming_it_and_takes_no_rank(monkeypatch, body, says):
    monkeypatch.delenv(BOOTSTRAP_TOKEN.name, raising=False)
    app, table = _server(guarded=True)
    (status, text), after = run(app, ("PUT", "/route", body, {}, "127.0.0.2"), ("PUT", "/route", REG, {}, "127.0.0.1"))
    assert status == 400 and says in text, (status, text)
    assert after[0] == 200 and table["0"]["rank_port"] == 17000  # the failed one claimed nothing


def test_reads_and_other_routes_pass(monkeypatch):
    monkeypatch.setenv(BOOTSTRAP_TOKEN.name, "s3cret")
    app, _ = _server(guarded=True)
    put, get = run(app, ("PUT", "/route", REG, bootstrap_auth.headers(), "127.0.0.1"),
                   ("GET", "/route?key=0", b"", {}, "127.0.0.2"))
    assert put[0] == 200 and get == (200, json.dumps({"rank_ip": "10.0.0.1", "rank_port": 17000}))


def test_the_rank_table_is_bounded(monkeypatch):
    monkeypatch.setattr(bootstrap_auth, "RANKS_MAX", 2)
    r = bootstrap_auth.Registrants()
    keys = [bootstrap_auth.rank_key({**REG, "attn_tp_rank": i}) for i in range(3)]
    assert [r.claim(k, "a") for k in keys[:2]] == [None, None]
    assert "more than 2" in r.claim(keys[2], "a") and r.claim(keys[0], "a") is None
