#!/usr/bin/env bash
# Builds everything this machine can build (the CUDA sources too when nvcc is
# present) with warnings as errors, then runs the whole test suite. GPU tests
# skip, saying so, when no GPU is present. Then builds the Python package into
# .venv (scripts/install-python-deps.sh) and runs its pytest suite
# (tests/python): the numpy tests run everywhere; the torch tests skip, saying
# so, where torch is not installed (this command installs none: it is large;
# .ci/run's torch part installs it and runs them on CPU tensors).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSEPAGE_WERROR=ON
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs"

echo "== Python package: pip install . into .venv, then pytest tests/python"
bash scripts/install-python-deps.sh
# The extension is built with the CPU backend only by default here: the C++
# build above already compiled the CUDA sources once, and no test here can run
# them without a GPU. PY_CUDA=AUTO (or ON) builds it with CUDA when nvcc exists.
CMAKE_BUILD_PARALLEL_LEVEL=$jobs .venv/bin/python -m pip install --no-build-isolation --disable-pip-version-check -q . \
  -C cmake.define.SPARSEPAGE_CUDA="${PY_CUDA:-OFF}" -C cmake.define.SPARSEPAGE_WERROR=ON
# pytest exits 5 when it collected no test; that is a failure here too (the
# CPU tests must run), so no special case.
.venv/bin/python -m pytest -p no:cacheprovider -q -rs tests/python
