#!/usr/bin/env bash
# Set up (once), start the embedded service (bundled Redis, local Ray with one prefill and one
# decode worker, the router on 127.0.0.1:50051, the bundled SmolLM2-135M-Instruct), ask it a
# question, and keep it serving until Ctrl-C. Extra arguments go to `pdserve up`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
read -r host port < <(.venv/bin/python -c \
    "from pdserve import defaults; print(defaults.HOST, defaults.ROUTER_PORT)")
address="${PDSERVE_HOST:-$host}:${PDSERVE_PORT:-$port}"
.venv/bin/pdserve up "$@" &
server=$!
trap 'kill -INT "$server" 2>/dev/null; wait "$server"; exit 130' INT TERM
until .venv/bin/python -c "import pdserve; pdserve.Client('$address').wait_ready(2)" \
        2>/dev/null; do
    kill -0 "$server" 2>/dev/null || { wait "$server"; exit 1; }  # it failed to start
done
.venv/bin/pdserve generate "What is the capital of France?" --address "$address"
echo "pdserve is serving at $address; try: .venv/bin/pdserve chat   (Ctrl-C here stops it)"
wait "$server"
