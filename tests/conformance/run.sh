#!/usr/bin/env bash
# Conformance with the real CuPy, as CI runs it (no GPU; docs/guide/testing.md):
#  1. the device tests on the stand-in under mpiexec -n 2, recording every call cupycomm makes
#     to CUDA/CuPy/NCCL as a call shape (CUPYCOMM_RECORD_CALL_SHAPES);
#  2. each shape replayed on the CuPy of the environment (CuPy 14.x);
#  3. and on CuPy 13.6, in a venv of its own kept between runs (CUPYCOMM_CUPY13_VENV, default
#     ~/.cache/cupycomm/venv-cupy13.6: only CuPy, NCCL and NumPy; made on first use).
# Prints "N call shapes replayed on CuPy X: M mismatches" for each; exits non-zero on any
# mismatch or failed test.
#
#   bash tests/conformance/run.sh     # from a fresh clone too: uses (or makes) .venv as
#                                     # tests/run.sh does, unless a venv is active
#   RECORDED=dir bash tests/conformance/run.sh   # replay shapes already recorded in dir (CI
#                                     # records them during the whole suite, saving a pass)
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
if ! python -c 'import cupy, cupycomm, pytest' 2>/dev/null; then
    extras=test,cuda12
    if [ -z "${MPIEXEC:-}" ] && ! command -v mpiexec >/dev/null; then
        extras=$extras,mpich
    fi
    python -m pip install -q -e ".[$extras]"
fi

if [ -n "${RECORDED:-}" ]; then
    shapes=$RECORDED
else
    shapes=$(mktemp -d "${TMPDIR:-/tmp}/cupycomm-shapes.XXXXXX")
    trap 'rm -rf "$shapes"' EXIT
    eval "launcher=($(python -m cupycomm.run.launchers -n 2 --leave-cleanup-to-cupycomm))"
    echo "+ recording call shapes: ${launcher[*]} python -m pytest (the device tests)"
    CUPYCOMM_RECORD_CALL_SHAPES=$shapes timeout 600 "${launcher[@]}" python -m pytest tests -q \
        --color=no -p no:cacheprovider -k "standin or device or prefetch or graph or foreign" "$@"
    echo "  (recorded in $SECONDS s)"
fi

status=0
python -m tests.conformance.replay "$shapes" || status=$?

old=${CUPYCOMM_CUPY13_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/cupycomm/venv-cupy13.6}
if ! "$old/bin/python" -c 'import cupy; assert cupy.__version__.startswith("13.6.")' \
        2>/dev/null; then
    echo "+ making $old (CuPy 13.6)"
    python3 -m venv --clear "$old"
    "$old/bin/pip" install -q 'cupy-cuda12x==13.6.*' nvidia-nccl-cu12
    echo "  (made, $SECONDS s since the start)"
fi
"$old/bin/python" -m tests.conformance.replay "$shapes" || status=$?
echo "  (conformance: $SECONDS s in all)"
exit "$status"
