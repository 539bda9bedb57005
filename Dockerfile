# The hardened SGLang image: the official upstream image of the same release
# with its sglang replaced by the hardened wheel. Build it with
#   scripts/build-image --base 0.5.23
# which builds the wheels and passes the build args below from the wheel's
# manifest (the one source of the version and hardening ids); the build
# context is a directory holding exactly those two wheels.
#
# BASE_IMAGE: upstream publishes lmsysorg/sglang:v<release> (CUDA 13 builds;
# CUDA 12 tags carry a suffix, e.g. v0.5.19-cu129). The tag is pinned to the
# release the wheel was built from; the name is fully qualified, as buildah
# resolves no short names by default. Tests substitute a CPU stand-in.
ARG SGLANG_BASE=0.5.23
ARG BASE_IMAGE=docker.io/lmsysorg/sglang:v${SGLANG_BASE}
FROM ${BASE_IMAGE}

ARG BASE_IMAGE
ARG HARDENED_VERSION
ARG HARDENING_IDS
ARG UPSTREAM_SHA256
ARG TOOL_VERSION

# What the wheel's manifest says; scripts/build-image adds what only the build knows, each
# where known: org.opencontainers.image.source, .revision, .created and .base.digest.
LABEL org.opencontainers.image.title="sglang-hardened" \
      org.opencontainers.image.description="SGLang with the sglang-hardened patch series for multi-tenant prefill/decode serving" \
      org.opencontainers.image.version="${HARDENED_VERSION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      sglang-hardened.hardening-ids="${HARDENING_IDS}" \
      sglang-hardened.upstream-sha256="${UPSTREAM_SHA256}" \
      sglang-hardened.tool-version="${TOOL_VERSION}"

# Offline and without dependencies: everything else sglang needs is the
# upstream image's own (click, pyyaml, packaging and aiohttp for the tool included).
# The wheels are bind-mounted (BuildKit, buildah), so no layer keeps them;
# `info` fails the build if the result is not a hardened sglang.
RUN --mount=type=bind,target=/wheels \
    test -n "${HARDENED_VERSION}" -a -n "${TOOL_VERSION}" \
      || { echo "pass the build args: build with scripts/build-image" >&2; exit 1; } \
 && python3 -m pip install --no-index --no-deps --no-cache-dir --find-links /wheels \
      "sglang==${HARDENED_VERSION}" "sglang-hardened==${TOOL_VERSION}" \
 && sglang-hardened info

# The server runs as a user of its own, numeric so that a pod's runAsNonRoot can check it (uid
# 1000 is taken by the ubuntu user of upstream's Ubuntu 24.04 base). Its home is the working
# directory and holds what SGLang and its kernels write at run time (~/.cache: Hugging Face,
# FlashInfer's and DeepGEMM's JIT; ~/.triton); /sgl-workspace, upstream's source tree, stays
# root's. RDMA then pins memory within the memlock limit the container is given (docs/image.md).
ARG SGLANG_UID=10001
RUN groupadd --gid "${SGLANG_UID}" sglang \
 && useradd --uid "${SGLANG_UID}" --gid "${SGLANG_UID}" --create-home --home-dir /home/sglang \
      --shell /usr/sbin/nologin sglang \
 && install -d -o "${SGLANG_UID}" -g "${SGLANG_UID}" /home/sglang/.cache /home/sglang/.triton
ENV HOME=/home/sglang
WORKDIR /home/sglang
USER ${SGLANG_UID}:${SGLANG_UID}

# SGLang's default port; set this too when passing --port to the server.
ENV SGLANG_HARDENED_HEALTH_PORT=30000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ['SGLANG_HARDENED_HEALTH_PORT'], timeout=4)"]

# `launch` applies the hardening policy's environment defaults (each
# override logged) and the start-up checks, then starts SGLang's server with
# the arguments given to `docker run`.
ENTRYPOINT ["sglang-hardened", "launch", "--"]
CMD ["--help"]
