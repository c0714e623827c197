#!/usr/bin/env bash
# Set up (once), then lint and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest "$@"
status=$?
set -e
if [[ $status -eq 5 ]]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit $status
