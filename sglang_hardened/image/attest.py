"""Provenance and signatures for a built image, made and checked offline with a local key.

The build writes an in-toto Statement (SLSA provenance v1) whose subject is the image's ID,
the digest of its config, which names its layers and settings and, unlike the local
manifest's digest, is the same after a push. With a signing key (a PEM key openssl reads:
ECDSA P-256, as cosign uses, or RSA) it also writes both statements, provenance and SBOM,
as DSSE envelopes, one a line: the in-toto attestation format ``cosign attest`` makes and
``cosign verify-attestation`` reads. openssl signs and checks, so no signing library
comes along with the tool. CI signs keyless after the push instead (docs/image.md).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import subprocess
import tempfile
from pathlib import Path

from .. import __version__
from ..common.errors import HardenedError

STATEMENT = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
PROVENANCE = "https://slsa.dev/provenance/v1"
CYCLONEDX = "https://cyclonedx.org/bom"
BUILD_TYPE = "urn:sglang-hardened:image-build:v1"  # scripts/build-image: the wheels, then the Dockerfile


def timestamp(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def statement(tag: str, image_id: str, predicate_type: str, predicate: dict) -> dict:
    """An in-toto Statement about the image ``tag`` whose ID is ``image_id`` (``sha256:...``)."""
    algorithm, _, digest = image_id.partition(":")
    return {"_type": STATEMENT, "subject": [{"name": tag, "digest": {algorithm: digest}}],
            "predicateType": predicate_type, "predicate": predicate}


def provenance(*, engine: str, platform: str, args: dict[str, str], base_image: str, base_digest: str | None,
               source: str | None, revision: str | None, inputs: list[Path], started: dt.datetime,
               finished: dt.datetime) -> dict:
    """The SLSA provenance v1 predicate: what was built from what (the source revision, the
    base image, the wheels and the Dockerfile, each by digest), by whom, when."""
    resolved = [{"name": path.name, "digest": {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}}
                for path in inputs]
    if revision:
        resolved.insert(0, {"uri": source or "", "digest": {"gitCommit": revision.removesuffix("-dirty")},
                            "annotations": {"dirty": revision.endswith("-dirty")}})
    base = {"uri": base_image}
    if base_digest:
        base["digest"] = dict([base_digest.split(":", 1)])
    return {
        "buildDefinition": {"buildType": BUILD_TYPE,
                            "externalParameters": {"base_image": base_image, "platform": platform, "engine": engine},
                            "internalParameters": {"build_args": args},
                            "resolvedDependencies": [base, *resolved]},
        "runDetails": {"builder": {"id": f"urn:sglang-hardened:image:{engine}", "version": {"sglang-hardened": __version__}},
                       "metadata": {"startedOn": timestamp(started), "finishedOn": timestamp(finished)}},
    }


def _pae(payload_type: str, body: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is signed, so the type cannot be swapped."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(body), body)


def _openssl(args: list[str], data: bytes) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["openssl", *args], input=data, capture_output=True)
    except FileNotFoundError:
        raise HardenedError("signing and verifying need openssl on the PATH") from None


def public_key(key: Path) -> bytes:
    """The PEM public key of the private ``key`` (or of a public one, as it is)."""
    text = key.read_bytes()
    if b"PUBLIC KEY" in text:
        return text
    done = _openssl(["pkey", "-pubout", "-in", str(key)], b"")
    if done.returncode != 0:
        raise HardenedError(f"openssl cannot read the key {key}: {done.stderr.decode().strip()}")
    return done.stdout


def key_id(public_pem: bytes) -> str:
    """The signature's keyid: the sha256 of the public key's PEM, so a verifier picks its key."""
    return hashlib.sha256(public_pem.strip()).hexdigest()


def sign(statement_: dict, key: Path) -> dict:
    """``statement_`` as a DSSE envelope signed with ``key`` (SHA-256)."""
    body = json.dumps(statement_, sort_keys=True, separators=(",", ":")).encode()
    done = _openssl(["dgst", "-sha256", "-sign", str(key)], _pae(PAYLOAD_TYPE, body))
    if done.returncode != 0:
        raise HardenedError(f"openssl could not sign with {key}: {done.stderr.decode().strip()}")
    return {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(body).decode(),
            "signatures": [{"keyid": key_id(public_key(key)), "sig": base64.b64encode(done.stdout).decode()}]}


def verified(envelope: dict, public_pem: bytes) -> dict:
    """The statement in ``envelope`` if a signature of it checks against ``public_pem``; raises otherwise."""
    body = base64.b64decode(envelope["payload"])
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "key.pub").write_bytes(public_pem)
        for signature in envelope.get("signatures", []):
            (Path(tmp) / "sig").write_bytes(base64.b64decode(signature["sig"]))
            done = _openssl(["dgst", "-sha256", "-verify", f"{tmp}/key.pub", "-signature", f"{tmp}/sig"],
                            _pae(envelope["payloadType"], body))
            if done.returncode == 0:
                return json.loads(body)
    raise HardenedError("no signature of the envelope checks against the given public key")


def verify_image(attestations: Path, sbom: Path, public_pem: bytes, image_id: str) -> list[dict]:
    """Check, offline, what the build wrote beside the image ``image_id``: every envelope in
    ``attestations`` signed by the key, each about this image, one of them SLSA provenance
    and one the SBOM in ``sbom`` as it is now. Returns the statements; raises on the first fault."""
    statements = [verified(json.loads(line), public_pem) for line in attestations.read_text().splitlines() if line]
    algorithm, _, digest = image_id.partition(":")
    for found in statements:
        if found.get("_type") != STATEMENT or [s["digest"].get(algorithm) for s in found["subject"]] != [digest]:
            raise HardenedError(f"{attestations.name}: a statement is not about the image {image_id}")
    kinds = {found["predicateType"]: found["predicate"] for found in statements}
    if set(kinds) != {PROVENANCE, CYCLONEDX}:
        raise HardenedError(f"{attestations.name}: expected SLSA provenance and a CycloneDX SBOM, found {sorted(kinds)}")
    if kinds[CYCLONEDX] != json.loads(sbom.read_text()):
        raise HardenedError(f"{sbom.name} is not the SBOM the build signed")
    return statements
