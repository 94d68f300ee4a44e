#!/usr/bin/env bash
# Conformance with the real CuPy, as CI runs it (no GPU needed):
#  1. the device tests on the stand-in under mpiexec -n 2, recording every call cupycomm makes
#     to CUDA/CuPy/NCCL as a call shape (CUPYCOMM_RECORD_CALL_SHAPES);
#  2. each shape replayed on the CuPy of the active environment (CuPy 14.x);
#  3. and on CuPy 13.6, in a venv of its own kept between runs (CUPYCOMM_CUPY13_VENV, default
#     ~/.cache/cupycomm/venv-cupy13.6: only CuPy, NCCL and NumPy; made on first use).
# Prints "N call shapes replayed on CuPy X: M mismatches" for each; exits non-zero on any
# mismatch or failed test.
#
#   bash tests/conformance/run.sh            # in the project's venv (tests/run.sh makes one)
set -euo pipefail
cd "$(dirname "$0")/../.."

shapes=$(mktemp -d "${TMPDIR:-/tmp}/cupycomm-shapes.XXXXXX")
trap 'rm -rf "$shapes"' EXIT
launcher=()
if mpiexec --version 2>/dev/null | grep -q HYDRA; then
    launcher=(-disable-auto-cleanup)
fi
echo "+ recording call shapes: mpiexec -n 2 python -m pytest (the device tests)"
CUPYCOMM_RECORD_CALL_SHAPES=$shapes timeout 600 \
    mpiexec ${launcher[@]+"${launcher[@]}"} -n 2 python -m pytest tests -q -p no:cacheprovider \
    -k "standin or device or prefetch or graph or foreign" "$@"

echo "  (recorded in $SECONDS s)"
status=0
python -m tests.conformance.replay "$shapes" || status=$?

old=${CUPYCOMM_CUPY13_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/cupycomm/venv-cupy13.6}
if ! "$old/bin/python" -c 'import cupy; assert cupy.__version__.startswith("13.6.")' \
        2>/dev/null; then
    echo "+ making $old (CuPy 13.6)"
    python3 -m venv --clear "$old"
    "$old/bin/pip" install -q 'cupy-cuda12x==13.6.*' nvidia-nccl-cu12
    echo "  (made in $SECONDS s since the start)"
fi
"$old/bin/python" -m tests.conformance.replay "$shapes" || status=$?
echo "  (conformance: $SECONDS s in all)"
exit "$status"
