#!/usr/bin/env bash
# The Python package on a GPU machine (torch installed, no network): build it
# with the CUDA backend into a scratch target, print what the build linked,
# probe exceptions and iostreams in a subprocess, run tests/python (numpy and
# torch suites), then the op-overhead, DSA-vs-PyTorch, engine-input and
# layer-step-vs-PyTorch benchmarks (BENCHES selects them).
# Logs go to $OUT. Wheels of the pinned build backends may be passed in WHEELS
# (a folder); otherwise the machine's scikit-build-core and nanobind are used.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sparsepage-py-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
site=/tmp/sparsepage-py-site
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sparsepage-py-build-deps "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/sparsepage-py-build-deps
fi
echo "== toolchain: $(g++ --version | head -1); $(python3 --version); LDFLAGS='${LDFLAGS:-}' CXXFLAGS='${CXXFLAGS:-}' LD_PRELOAD='${LD_PRELOAD:-}'"
t0=$(date +%s)
rm -rf "$site"  # pip --target leaves an existing package in place: start clean, so this tree's code is what runs
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-index --no-build-isolation --no-deps -v --target "$site" . \
  -C cmake.define.SPARSEPAGE_CUDA=ON -C cmake.define.CMAKE_VERBOSE_MAKEFILE=ON -C build-dir=/tmp/sparsepage-py-cmake \
  > "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; echo "build failed"; exit 1; }
echo "== build: $(( $(date +%s) - t0 )) s"
echo "== link line of the extension:"; grep -E "\-o [^ ]*_core[^ ]*\.so" "$OUT/build.log" | tail -1 | cut -c1-1500
so=$(ls "$site"/sparsepage/_core*.so)
ldd "$so" | grep -E "stdc|gcc_s" ; echo "exported symbols: $(nm -D --defined-only "$so" | wc -l)"
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
python3 -c '
import sparsepage as sp
print("built_with_cuda", sp.built_with_cuda(), "cuda_available", sp.cuda_available())
try:
    sp.build_page_table_structure([-1], 1)
except sp.Error as e:
    print("exception probe ok:", e)
print("describe probe ok:", sp.SparseDecodeOutcome().describe())' || echo "PROBE FAILED (rc=$?)"
python3 -m pytest -p no:cacheprovider -q -rs tests/python 2>&1 | tee "$OUT/pytest.log" | tail -30
# BENCHES picks the benchmarks (default: all four).
BENCHES=${BENCHES:-"overhead dsa engine layers"}
[[ $BENCHES == *overhead* ]] && python3 python/benchmarks/op_overhead.py 2>&1 | tee "$OUT/overhead.log"
[[ $BENCHES == *dsa* ]] && python3 python/benchmarks/dsa_vs_torch.py 2>&1 | tee "$OUT/dsa_vs_torch.log"
[[ $BENCHES == *engine* ]] && python3 python/benchmarks/engine_decode.py 2>&1 | tee "$OUT/engine_decode.log"
[[ $BENCHES == *layers* ]] && python3 python/benchmarks/layer_steps_vs_torch.py 2>&1 | tee "$OUT/layer_steps.log"
exit 0
