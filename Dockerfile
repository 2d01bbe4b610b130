# syntax=docker/dockerfile:1
# Ductor's container image: the `ductor` binary and the example step worker
# (`ductor-example-worker`), on a slim Debian. Used by docker-compose.yml.
#
#   docker build -t ductor .                   compile inside the image (target runtime)
#   cargo build --release --bin ductor --example worker
#   docker build --target prebuilt -t ductor . take the host's binaries instead
#
# The base images are build arguments, so that an image can be built where
# the upstream ones cannot be pulled (a mirror, or a base made locally, as
# scripts/container-test does):
#
#   --build-arg BUILDER_IMAGE=...   a Rust toolchain on Debian bookworm
#   --build-arg RUNTIME_IMAGE=...   Debian bookworm; libssl3 and
#                                   ca-certificates are installed if missing
#
# `prebuilt` copies the binaries from PREBUILT_DIR in the build context
# (default target/release, where cargo puts them without CARGO_TARGET_DIR):
# they must have been built against the runtime image's Debian release (or
# an older one), or they ask for a glibc / libssl it does not have.
ARG BUILDER_IMAGE=rust:1-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

# ---- build ------------------------------------------------------------------
# rust:1-bookworm rather than plain rust:1, whose Debian release moves on: the
# builder must not be newer than the runtime stage, or the binary asks for a
# glibc / libssl the runtime image does not have.
FROM ${BUILDER_IMAGE} AS builder
# rdkafka builds its bundled librdkafka (C/C++, cmake) and links the system
# OpenSSL ("ssl" feature) and zlib.
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake pkg-config libssl-dev zlib1g-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# Cache mounts (BuildKit) keep the crate registry and the target dir between
# builds, so a source change rebuilds incrementally. The target dir is a cache
# mount and so absent from the image: copy the binaries out in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin ductor --example worker \
 && install -D -m 0755 target/release/ductor /out/ductor \
 && install -D -m 0755 target/release/examples/worker /out/ductor-example-worker

# ---- the runtime base, shared by both ways of getting the binaries ----------
FROM ${RUNTIME_IMAGE} AS base
# libssl3 for the binary, ca-certificates for TLS to Kafka and Postgres,
# openssl for ductor-admin-tls. Only what is missing is installed, so a base
# that already has all three (or that cannot reach a Debian mirror) needs
# no apt-get.
RUN if [ "$(dpkg-query -W -f='${db:Status-Abbrev}\n' libssl3 ca-certificates openssl 2>/dev/null | grep -c '^ii')" = 3 ]; then \
      echo "libssl3, ca-certificates and openssl are already installed"; \
    else \
      apt-get update \
      && apt-get install -y --no-install-recommends libssl3 ca-certificates openssl \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin ductor
# The configuration refers to paths relative to the working directory
# (coordinator.workflows_dir = "config/workflows"), so config/ ships beside it.
WORKDIR /app
COPY config ./config
# Inside a container the public listener may not be loopback-only: the
# container's loopback is its own, and nothing outside it (a port mapping)
# would reach it. The admin listener (/metrics, the detailed /readyz, the
# operator's endpoints) stays on the container's loopback: serve refuses a
# non-loopback one unless it takes admin keys over TLS. To open it to a
# scraper, set DUCTOR__SERVER__ADMIN_LISTEN=0.0.0.0:9464,
# DUCTOR__SERVER__ADMIN_AUTH=key and the admin_tls_* files, and give the
# scraper a key made with `ductor keys create --scopes admin`, as
# docker-compose.yml does (ductor-admin-tls makes the certificate).
ENV DUCTOR__SERVER__LISTEN=0.0.0.0:8080
EXPOSE 8080 9464
# The healthchecks of docker-compose.yml, without curl in the image (see the
# script): `ductor-healthcheck serve` asks the public /readyz,
# `ductor-healthcheck worker` looks for the worker's connection to Kafka.
# ductor-admin-tls makes the admin listener's certificate for it.
COPY --chmod=0755 scripts/container/healthcheck /usr/local/bin/ductor-healthcheck
COPY --chmod=0755 scripts/container/admin-tls /usr/local/bin/ductor-admin-tls
USER ductor
CMD ["ductor", "serve"]

# ---- the host's binaries ----------------------------------------------------
FROM base AS prebuilt
ARG PREBUILT_DIR=target/release
COPY --chmod=0755 ${PREBUILT_DIR}/ductor /usr/local/bin/ductor
COPY --chmod=0755 ${PREBUILT_DIR}/examples/worker /usr/local/bin/ductor-example-worker

# ---- compiled in the builder (the default target) ---------------------------
FROM base AS runtime
COPY --from=builder /out/ductor /out/ductor-example-worker /usr/local/bin/
