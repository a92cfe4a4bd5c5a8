#!/usr/bin/env bash
# The test command of the README (and of CI): set up (scripts/setup.sh: .venv or the active venv), then
# lint and run every test on the CPU with that environment's python.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY="${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}"
PY="${PY:-.venv/bin/python}"
if ! command -v chromium >/dev/null 2>&1; then  # for the app's browser test (Playwright drives Debian's chromium)
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium could not be installed"
fi
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m pytest -q -p no:cacheprovider "$@"
