# syntax=docker/dockerfile:1
# One image for both parts of edl-agent (README: Quick start):
#   edl-agent run        the node agent (deploy/daemonset/agent-daemonset.yaml; the DaemonSet runs
#                        it as uid 0 with every capability dropped, for kubelet's root-owned
#                        socket directories)
#   edl-agent restarter  the restarter (deploy/daemonset/restarter-deployment.yaml; the image's
#                        non-root user)
# Build: docker build -t ghcr.io/edl-agent/edl-agent:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# Wheels of edl-agent and every dependency (grpcio, protobuf, kubernetes ... come as binary
# wheels), so the runtime stage needs no build tools and keeps no source tree.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY edl_agent ./edl_agent
RUN pip wheel --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Installed from the build stage's wheels only (--no-index); pip compiles the bytecode now,
# since both pods run with a read-only root filesystem.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index /wheels/*.whl \
    && useradd --system --uid 65532 --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin edl
# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 65532:65532
LABEL org.opencontainers.image.title="edl-agent" \
      org.opencontainers.image.description="Node agent and central restarter for accelerator clusters on Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
ENTRYPOINT ["edl-agent"]
CMD ["--help"]
