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
# Two test processes, a file's tests in one (module fixtures built once): on the 2-core CI machine (AVX2
# host, 2026-12-03) the suite took 1,003 s against 1,225-1,408 s in one process.
"$PY" -m pytest -q -p no:cacheprovider -n auto --maxprocesses 2 --dist loadfile "$@"
