# The fusestate image used by the Helm chart (helm/fusestate):
#     docker build -t REGISTRY/fusestate:0.1.0 .
#     docker push REGISTRY/fusestate:0.1.0
# The container needs /dev/fuse and a privileged security context; the chart sets both.

FROM debian:bookworm-slim AS build
# Unpinned on purpose: bookworm's packages, with its security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential pkg-config libfuse3-dev python3 python3-dev python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fusestate ./fusestate
RUN python3 -m venv /opt/fusestate/.venv \
    && /opt/fusestate/.venv/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/fusestate/.venv/bin/pip install --no-cache-dir .

FROM debian:bookworm-slim
# fuse3: fusermount3, which unmounts; util-linux (in the base image): mountpoint, for the readiness probe.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends fuse3 libfuse3-3 python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/fusestate/.venv /opt/fusestate/.venv
ENV PATH=/opt/fusestate/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1
ENTRYPOINT ["fusestate"]
CMD ["--help"]
