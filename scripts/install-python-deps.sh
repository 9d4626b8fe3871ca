#!/usr/bin/env bash
# Creates the project's virtual environment .venv/ (git-ignored) and installs
# the pinned Python build and test dependencies into it with pip, from PyPI.
# A venv, because the machine's python3 may be externally managed (PEP 668)
# and because nothing here should touch the system's site-packages.
# Idempotent: an existing .venv with everything pinned installed is left alone.
# torch is not installed by default (its wheels bring the CUDA libraries,
# about 4.5 GB); the torch tests skip without it. Options (any order):
#   --torch  also torch, at the version the GPU machine has, so the torch
#            tests run on CPU tensors (.ci/run's torch part);
#   --plots  also matplotlib, which scripts/plot_steps.py needs.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "install-python-deps: creating $venv with $($python --version 2>&1)"
  "$python" -m venv "$venv"
fi
reqs=(scikit-build-core==0.11.6 nanobind==2.9.2 pytest==8.4.2 numpy==2.3.5)
for arg in "$@"; do
  case "$arg" in
    --torch) reqs+=(torch==2.11.0) ;;
    --plots) reqs+=(matplotlib==3.10.7) ;;
    *) echo "install-python-deps: unknown option '$arg' (--torch, --plots)" >&2; exit 2 ;;
  esac
done
if ! "$venv/bin/python" -m pip show --quiet "${reqs[@]%%==*}" >/dev/null 2>&1 ||
   ! "$venv/bin/python" - "${reqs[@]}" <<'PY'
import sys
from importlib.metadata import version
sys.exit(any(version(r.split("==")[0]) != r.split("==")[1] for r in sys.argv[1:]))
PY
then
  echo "install-python-deps: installing ${reqs[*]}"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${reqs[@]}"
fi
