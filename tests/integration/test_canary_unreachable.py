"""The canary on a deployment that does not answer (#48): what its CronJob meets when the
preflight gate has taken the gateway out of service. It used to end in a traceback (an
uncaught URLError in the calibration request) and write no report."""

from __future__ import annotations

import http.server
import json
import socket
import threading

import pytest
from click.testing import CliRunner

from sglang_hardened.operations.cli import canary


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


@pytest.mark.parametrize("which", ["refused", "503"])
def test_a_deployment_that_does_not_answer_fails_the_canary_with_a_report(which, unavailable_url, tmp_path):
    url = f"http://127.0.0.1:{closed_port()}" if which == "refused" else unavailable_url
    out = tmp_path / "canary.json"
    result = CliRunner().invoke(canary, ["--url", url, "--pool-tokens", "256", "--context-length", "1024",
                                         "--json", str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output and "the deployment answers" in result.output, result.output
    report = json.loads(out.read_text())
    assert report["ok"] is False and any(c["name"] == "the deployment answers" and c["result"] == "FAIL"
                                         for c in report["checks"]), report
    assert ("did not answer" if which == "refused" else "HTTP 503") in out.read_text()
