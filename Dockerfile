# syntax=docker/dockerfile:1
# Ductor's container image: build with the Rust toolchain, run on a slim Debian.
# Used by docker-compose.yml; `docker build -t ductor .` works on its own too.

# ---- build ------------------------------------------------------------------
# rust:1-bookworm rather than plain rust:1, whose Debian release moves on: the
# builder must not be newer than the runtime stage, or the binary asks for a
# glibc / libssl the runtime image does not have.
FROM rust:1-bookworm AS builder
# rdkafka builds its bundled librdkafka (C/C++, cmake) and links the system
# OpenSSL ("ssl" feature) and zlib.
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake pkg-config libssl-dev zlib1g-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# Cache mounts (BuildKit) keep the crate registry and the target dir between
# builds, so a source change rebuilds incrementally. The target dir is a cache
# mount and so absent from the image: copy the binary out in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin ductor \
 && install -D -m 0755 target/release/ductor /out/ductor

# ---- run --------------------------------------------------------------------
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends libssl3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin ductor
COPY --from=builder /out/ductor /usr/local/bin/ductor
# The configuration refers to paths relative to the working directory
# (coordinator.workflows_dir = "config/workflows"), so ship config/ beside it.
WORKDIR /app
COPY --from=builder /src/config ./config
USER ductor
# Inside a container the public listener may not be loopback-only: the
# container's loopback is its own, and nothing outside it (a port mapping)
# would reach it. The admin listener (/metrics, the detailed /readyz, the
# operator's endpoints) stays on the container's loopback: serve refuses a
# non-loopback one unless it takes admin keys over TLS. To scrape it from
# outside, set DUCTOR__SERVER__ADMIN_LISTEN=0.0.0.0:9464,
# DUCTOR__SERVER__ADMIN_AUTH=key and the admin_tls_* files, and give the
# scraper a key made with `ductor keys create --scopes admin`.
ENV DUCTOR__SERVER__LISTEN=0.0.0.0:8080
EXPOSE 8080 9464
CMD ["ductor", "serve"]
