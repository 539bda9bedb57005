"""The operator commands on a deployment that does not answer, and their one meaning of
--json and exit codes (sglang_hardened/common/output.py). The canary's CronJob meets a dead
gateway whenever the preflight gate has taken it out of service: the canary used to end in a
traceback (an uncaught URLError in its first request) and write no report. Its prompts are
sized by prefill's /tokenize, which still answers (a word a token here)."""

from __future__ import annotations

import http.server
import json
import socket
import threading

import click
import pytest
from click.testing import CliRunner

from sglang_hardened.cli import main
from sglang_hardened.common.knobs import CACHE
from sglang_hardened.common.output import STDOUT, UNJUDGED
from sglang_hardened.operations.cli import canary, preflight
from sglang_hardened.sandbox.cli import sandbox


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


class Unavailable(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # a gateway with no healthy worker
        self.send_response(503)
        self.end_headers()
        self.wfile.write(b'{"error": "no available workers"}')

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def unavailable_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def tokenize_url(http_stand_in) -> str:
    return "http://" + http_stand_in(lambda path, body: (200, json.dumps({"count": [len(t.split()) for t in json.loads(body)["prompt"]]}).encode()))


@pytest.mark.parametrize("which", ["refused", "503"])
def test_a_deployment_that_does_not_answer_fails_the_canary_with_a_report(which, unavailable_url, tokenize_url, tmp_path):
    url = f"http://127.0.0.1:{closed_port()}" if which == "refused" else unavailable_url
    out = tmp_path / "canary.json"
    result = CliRunner().invoke(canary, ["--url", url, "--tokenize-url", tokenize_url, "--pool-tokens", "256",
                                         "--context-length", "1024", "--json", str(out)])
    assert result.exit_code == UNJUDGED and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output and "the deployment answers" in result.output, result.output
    report = json.loads(out.read_text())
    assert report["ok"] is False and report["unjudged"] is True and any(c["name"] == "the deployment answers" and c["result"] == "FAIL"
                                         for c in report["checks"]), report
    assert ("did not answer" if which == "refused" else "HTTP 503") in out.read_text()


def test_preflight_json_alone_is_stdout_that_parses_and_a_silent_node_is_unjudged(unavailable_url):
    dead = f"http://127.0.0.1:{closed_port()}"
    result = CliRunner().invoke(preflight, ["--prefill", dead, "--decode", dead, "--timeout", "2", "--json"])
    assert result.exit_code == UNJUDGED, result.output
    report = json.loads(result.stdout)  # the table went to stderr
    assert report["ok"] is False and report["unjudged"] is True
    assert dead in result.stderr and "not reachable" in result.stderr


def test_json_into_a_path_keeps_the_table_on_stdout(tmp_path):
    dead, out = f"http://127.0.0.1:{closed_port()}", tmp_path / "preflight.json"
    result = CliRunner().invoke(preflight, ["--prefill", dead, "--decode", dead, "--timeout", "2", "--json", str(out)])
    assert result.exit_code == UNJUDGED and "preflight: UNSAFE" in result.stdout
    assert json.loads(out.read_text())["unjudged"] is True and not list(tmp_path.glob(".*"))  # no temp file left


def _commands(group: click.Group, path: str = "") -> list[tuple[str, click.Command]]:
    """Every command under ``group``, by its full name."""
    found = []
    for name, command in group.commands.items():
        found += (_commands(command, f"{path}{name} ") if isinstance(command, click.Group)
                  else [(f"{path}{name}", command)])
    return found


def test_every_command_takes_json_the_same_way():
    """--json alone is stdout, --json PATH a file, for every command that has it (output.json_option)."""
    with_json = {name: p for name, command in _commands(main) for p in command.params if "--json" in p.opts}
    assert {"preflight", "canary", "info", "sandbox status", "sandbox soak"} <= set(with_json), sorted(with_json)
    odd = [name for name, p in with_json.items() if p.is_flag or p.flag_value != STDOUT or p.name != "json_to"]
    assert not odd, f"--json means something else in {odd}"


def test_sandbox_status_json_alone_or_into_a_path(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE.name, str(tmp_path / "cache"))
    alone = CliRunner().invoke(sandbox, ["status", "--name", "never-up", "--json"])
    assert alone.exit_code == 0 and json.loads(alone.stdout) == {"running": False}
    assert "'never-up' is not up" in alone.stderr
    out = tmp_path / "status.json"
    into = CliRunner().invoke(sandbox, ["status", "--name", "never-up", "--json", str(out)])
    assert into.exit_code == 0 and "'never-up' is not up" in into.stdout
    assert json.loads(out.read_text()) == {"running": False}



def test_a_pool_entry_without_an_address_is_left_out_not_a_traceback(http_stand_in):
    """smg's `GET /workers` with entries a newer or broken smg might send: no url."""
    from sglang_hardened.operations.gateway_pool import pool

    body = {"workers": [{"worker_type": "prefill"}, {"worker_type": "prefill", "url": "http://10.0.0.1:30000"},
                        {"worker_type": "decode", "url": "http://10.0.0.2:30000"}, {"url": None}]}
    gateway = http_stand_in(lambda path: (200, json.dumps(body).encode()))
    found = pool(f"http://{gateway}", timeout=5, key="k")
    assert found == {"prefill": ["http://10.0.0.1:30000"], "decode": ["http://10.0.0.2:30000"]}


def test_the_drain_hook_waits_for_two_idle_polls_and_gives_up_naming_what_is_held(http_stand_in):
    """The recipe's preStop drain: it lets SIGTERM through only once the server held nothing on
    two polls in a row (a request between two polls is not missed), and past its timeout raises
    naming what is still held, rather than holding a rollout for ever; a server it cannot read
    is an error naming its URL."""
    from sglang_hardened.common.errors import HardenedError
    from sglang_hardened.operations.drain import drain

    busy = [3]  # polls' worth of work the server still holds

    def loads(path: str) -> tuple[int, bytes]:  # SGLang's /v1/loads, two DP ranks
        held = 1 if busy[0] > 0 else 0
        busy[0] -= 1
        ranks = [{"num_running_reqs": held, "num_waiting_reqs": 0, "num_used_tokens": 7 * held},
                 {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0}]
        return 200, json.dumps({"loads": ranks}).encode()

    server = f"http://{http_stand_in(loads)}"
    waited = drain(server, settle_s=0.0, timeout_s=30, poll_s=0.05)
    assert busy == [-2] and waited >= 4 * 0.05  # three busy polls, then two idle ones
    busy[0] = 10**6
    with pytest.raises(HardenedError, match=r"still holds 8 requests and KV tokens after 0 s"):
        drain(server, settle_s=0.0, timeout_s=0.2, poll_s=0.05)
    dead = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(HardenedError, match=rf"cannot read {dead}/v1/loads"):
        drain(dead, settle_s=0.0, timeout_s=1, poll_s=0.05)


@pytest.mark.parametrize("option", ["--url", "--tokenize-url"])
@pytest.mark.parametrize("bad", ["foo", "http://h:notaport", "ftp://x", "http://", "http://h:0", "http://h:1/p?q=1"])
def test_a_url_that_is_not_http_host_port_path_is_a_usage_error_naming_the_option(option, bad):
    args = {"--url": "http://127.0.0.1:9", "--tokenize-url": "http://127.0.0.1:9", option: bad}
    result = CliRunner().invoke(canary, [*(a for kv in args.items() for a in kv), "--pool-tokens", "256",
                                         "--context-length", "1024"])
    assert result.exit_code == 2 and option in result.output and bad in result.output, result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, ValueError), result.output


@pytest.mark.parametrize("which", ["/tokenize", "/generate"])
def test_a_200_that_is_not_json_leaves_the_canary_unjudged_naming_the_url(which, http_stand_in, tmp_path):
    """A real loopback server standing in for a proxy's HTML page where SGLang should answer."""
    def answer(path, body=b""):
        if path == which:
            return 200, b"<html>not SGLang</html>"
        return 200, json.dumps({"count": [len(t.split()) for t in json.loads(body)["prompt"]]}
                               if path == "/tokenize" else {"output_ids": [1, 2]}).encode()

    url = "http://" + http_stand_in(answer)
    out = tmp_path / "canary.json"
    result = CliRunner().invoke(canary, ["--url", url, "--pool-tokens", "256", "--context-length", "1024",
                                         "--json", str(out)])
    assert result.exit_code == UNJUDGED and isinstance(result.exception, SystemExit), result.output
    assert f"{url}{which}" in out.read_text() and "not SGLang" in out.read_text(), out.read_text()


def test_run_canary_called_with_a_url_urllib_cannot_send_to_reports_it_unjudged(tokenize_url):
    """The library call, which no click callback guards."""
    from sglang_hardened.operations.canary import ANSWERS, Plan, run_canary

    report = run_canary("http://h:notaport", Plan(256, 1024), tokenize_url=tokenize_url)
    assert report.unjudged and [c.name for c in report.checks] == [ANSWERS], report
    assert "http://h:notaport/generate did not answer" in report.checks[0].detail, report
