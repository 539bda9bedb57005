# The slim tool image: the sglang-hardened wheel alone on a small Python, for what judges the
# servers without serving (the gateway's preflight gate, the canary CronJob, deploy check),
# so those pods pull a hundred megabytes, not the CUDA serving image. Build it with
#   scripts/build-image --base 0.5.23 --tool
# which tags it sglang-hardened-tool:<the servers' tag> and passes the build args from the same
# hardened wheel's manifest as the servers' image: the same tool wheel, version and labels,
# so a gate never judges the servers with another release's rules.
ARG SGLANG_BASE=0.5.23
ARG BASE_IMAGE=docker.io/library/python:3.12-slim-bookworm
FROM ${BASE_IMAGE}

ARG BASE_IMAGE
ARG SGLANG_BASE
ARG HARDENED_VERSION
ARG HARDENING_IDS
ARG UPSTREAM_SHA256
ARG TOOL_VERSION

# What the manifest says, as in the servers' Dockerfile; scripts/build-image adds the source,
# revision, created and base digest labels.
LABEL org.opencontainers.image.title="sglang-hardened-tool" \
      org.opencontainers.image.description="The sglang-hardened tool (preflight, canary, deploy check) for the servers of the same version" \
      org.opencontainers.image.version="${HARDENED_VERSION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      sglang-hardened.base="${SGLANG_BASE}" \
      sglang-hardened.hardening-ids="${HARDENING_IDS}" \
      sglang-hardened.upstream-sha256="${UPSTREAM_SHA256}" \
      sglang-hardened.tool-version="${TOOL_VERSION}"

# The tool's few dependencies (click, pyyaml, packaging, aiohttp) come from the index unless the
# base has them (the tests' offline stand-in: --build-arg PIP_NO_INDEX=1, which pip reads from the
# environment); the wheel itself from the context, by its file name: asked for by name with the
# index on, pip could take a same-named, same-versioned package from the index instead.
ARG PIP_NO_INDEX=0
RUN --mount=type=bind,target=/wheels \
    test -n "${HARDENED_VERSION}" -a -n "${TOOL_VERSION}" \
      || { echo "pass the build args: build with scripts/build-image --tool" >&2; exit 1; } \
 && python3 -m pip install --no-cache-dir --find-links /wheels \
      "/wheels/sglang_hardened-${TOOL_VERSION}-py3-none-any.whl" \
 && sglang-hardened --version

# Nothing here writes outside a report path it is given: any numeric user will do (runAsNonRoot).
USER 10001:10001
ENTRYPOINT ["sglang-hardened"]
CMD ["--help"]
