#!/usr/bin/env bash
# The GPU check (docs/gpu.md). Here, once per change: scripts/gpu_check.sh --prepare
# On a lent GPU (the device tool, carry [".gpu_check"]): bash scripts/gpu_check.sh
# On a CPU (every step starts; the CUDA ones say "no CUDA"): scripts/gpu_check.sh --dry-run
# The check runs in the image's Python (PDSERVE_GPU_PYTHON, default python3), not the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
    if [[ "$arg" == "--prepare" ]]; then
        exec .venv/bin/python scripts/gpu_check.py "$@"
    fi
done
exec "${PDSERVE_GPU_PYTHON:-python3}" scripts/gpu_check.py "$@"
