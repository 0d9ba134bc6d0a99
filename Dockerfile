# Builds the `kairos` binary (scheduler, worker, command line).
FROM rust:1.89-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends \
        build-essential cmake libssl-dev zlib1g-dev pkg-config python3 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY benches ./benches
COPY tests ./tests
RUN cargo build --release --locked --bin kairos

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libssl3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --home /var/lib/kairos kairos \
    && mkdir -p /var/lib/kairos/scheduler && chown -R kairos /var/lib/kairos
COPY --from=build /src/target/release/kairos /usr/local/bin/kairos
COPY config /etc/kairos
USER kairos
WORKDIR /var/lib/kairos
ENTRYPOINT ["kairos"]
