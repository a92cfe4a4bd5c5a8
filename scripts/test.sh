#!/usr/bin/env bash
# The test command of the README (and of CI): set up, then lint and run every test on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v chromium >/dev/null 2>&1; then  # for the app's browser test (Playwright drives Debian's chromium)
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium could not be installed"
fi
ruff check .
ruff format --check .
python3 -m pytest -q -p no:cacheprovider "$@"
