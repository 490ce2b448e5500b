# One image for every loramux service (engine, control plane, gateway).
# CPU build:  docker build -t loramux .
# CUDA build: docker build -t loramux --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY loramux_core loramux_core
COPY services services
COPY clients/python clients/python
RUN pip install --no-cache-dir . ./clients/python

# Non-root; the registry and the model cache live on volumes.
# Compiled Triton kernels go to /triton-cache (compose mounts a volume there), so the
# engine's start-up warm-up compiles once and later starts load them.
ENV TRITON_CACHE_DIR=/triton-cache
RUN useradd --create-home loramux && mkdir -p /models /adapters /state /keys /triton-cache \
    && chown loramux /models /adapters /state /keys /triton-cache && chmod 700 /keys
USER loramux
EXPOSE 50051 50052 9090
CMD ["loramux", "--help"]
