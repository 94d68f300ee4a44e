#!/usr/bin/env bash
# The whole suite, as CI runs it: set-up, then the tests in one process and under
# mpiexec -n 2, 3 and 4 (odd sizes find bugs). The single-process pass also runs the
# examples and the fault scripts, each under its own mpiexec.
#
#   bash tests/run.sh            # from a fresh clone; creates .venv unless one is active
#   bash tests/run.sh -x -k gather   # extra arguments go to every pytest run
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
python -m pip install -q --upgrade pip
# The CUDA extra only where no CuPy is installed yet: a GPU machine set up with '.[cuda13]'
# keeps its CuPy; elsewhere cuda12 (it imports without a GPU, and CUDA 13 drivers run it).
extras=test
python -c 'import cupy' 2>/dev/null || extras=test,cuda12
python -m pip install -q -e ".[$extras]"

status=0
run() {
    echo "+ $*"
    "$@" || status=$?
}
# MPICH's mpiexec (hydra) kills every rank itself when one exits without MPI_Finalize, and may
# then exit 0 (an os._exit(0)); without that cleanup, cupycomm's watchdog and the plugin's hang
# guard end the job, non-zero, naming the rank (see cupycomm.testing.no_auto_cleanup).
launcher=()
if mpiexec --version 2>/dev/null | grep -q HYDRA; then
    launcher=(-disable-auto-cleanup)
fi
# A hard bound on each pass on top of the plugin's per-test timeout: nothing can hang CI.
run timeout 900 python -m pytest tests "$@"
for n in 2 3 4; do
    run timeout 900 mpiexec ${launcher[@]+"${launcher[@]}"} -n "$n" python -m pytest tests "$@"
done
exit "$status"
