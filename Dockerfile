# One image for every loramux service (engine, control plane, gateway).
# CPU build:  docker build -t loramux .
# CUDA build: docker build -t loramux --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

# The same pins as the test suite (constraints.txt, from scripts/lock.sh); a CUDA build of
# torch brings the Triton it was built with, so only the CPU image takes the pinned one.
# The sources are installed, then removed: the image runs the installed loramux_* packages.
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY engine engine
COPY kernels kernels
COPY loramux_core loramux_core
COPY services services
COPY clients/python clients/python
RUN if [ "${TORCH_INDEX##*/}" = cpu ]; then cp constraints.txt /tmp/pins.txt; \
    else grep -v '^triton==' constraints.txt > /tmp/pins.txt; fi \
    && pip install --no-cache-dir -c /tmp/pins.txt . ./clients/python \
    && cd / && rm -rf /src /tmp/pins.txt
WORKDIR /app

# Non-root; the registry and the model cache live on volumes.
# Compiled Triton kernels go to /triton-cache (compose mounts a volume there), so the
# engine's start-up warm-up compiles once and later starts load them.
ENV TRITON_CACHE_DIR=/triton-cache
RUN useradd --create-home loramux && mkdir -p /models /adapters /state /keys /triton-cache \
    && chown loramux /models /adapters /state /keys /triton-cache && chmod 700 /keys
USER loramux
EXPOSE 50051 50052 9090
CMD ["loramux", "--help"]
