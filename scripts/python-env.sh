#!/usr/bin/env bash
# The Python environment the package is built, linted and tested in: a virtualenv in
# .tools/pyenv (override with TRIMUL_PYENV) with pytest, numpy, ruff and PyTorch 2.11 from PyPI
# (its CUDA wheels: `import torch` needs them even without a GPU; about a minute and 4.7 GB).
# Idempotent. Source it to get $PY (the interpreter) and $PYENV.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYENV="${TRIMUL_PYENV:-$root/.tools/pyenv}"
if [ ! -x "$PYENV/bin/python" ]; then
  python3 -m venv "$PYENV"
fi
if ! "$PYENV/bin/python" -c "import pytest, numpy, torch, ruff" >/dev/null 2>&1; then
  echo "python-env: installing pytest, numpy, ruff and torch 2.11 into $PYENV" >&2
  "$PYENV/bin/pip" install -q --disable-pip-version-check pytest numpy ruff "torch==2.11.0"
fi
PY="$PYENV/bin/python"
export PY PYENV
