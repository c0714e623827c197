#!/usr/bin/env bash
# Set up (once), then answer a question with the bundled SmolLM2-135M-Instruct.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve generate "${1:-What is the capital of France?}" "${@:2}"
