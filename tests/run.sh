#!/usr/bin/env bash
# The whole suite, as CI runs it: set-up, then the tests in one process and under
# mpiexec -n 2, 3 and 4 (odd sizes find bugs). The single-process pass also runs the
# examples and the fault scripts, each under its own mpiexec.
#
#   bash tests/run.sh                # from a fresh clone; creates .venv unless one is active
#   bash tests/run.sh -x -k gather   # extra arguments go to every pytest run
#   MPIEXEC=/opt/mpi/bin/mpiexec bash tests/run.sh      # that launcher (srun as well)
#   RANKS="1 3" TESTS="tests/faults/test_abort.py" bash tests/run.sh   # some sizes, some files
#   UNDER_MPIEXEC=1 bash tests/run.sh   # every size, 1 too, as `mpiexec -n N python -m pytest`
#
# The MPI is the environment's: $MPIEXEC, else the active environment's mpiexec or the one on
# PATH (cupycomm.run.launchers finds it and adds the options it needs, e.g. Open MPI's
# --oversubscribe past the cores). Only where there is none does this install MPICH's wheel
# (the mpich extra); an MPI that is there is never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
# Set-up, skipped where it is done (cupycomm installed from this checkout, with the test
# extra's packages, CuPy and an MPI): CI runs this once per MPI and Python.
installed() {
    python -I - "$PWD" <<'EOF' 2>/dev/null   # -I: not this directory's egg-info
import importlib.metadata, json, sys
import cupy, matplotlib, ml_dtypes, pytest  # noqa: F401 (the test extra's, and CuPy)
source = json.loads(importlib.metadata.distribution("cupycomm").read_text("direct_url.json"))
sys.exit(source["url"] != "file://" + sys.argv[1])
EOF
}
has_mpi() {
    [ -n "${MPIEXEC:-}" ] || command -v mpiexec >/dev/null
}
if ! installed || ! has_mpi; then
    python -m pip install -q --upgrade pip
    # The CUDA extra only where no CuPy is installed yet: a GPU machine set up with
    # '.[cuda13]' keeps its CuPy; elsewhere cuda12 (it imports without a GPU, and CUDA 13
    # drivers run it).
    extras=test
    python -c 'import cupy' 2>/dev/null || extras=$extras,cuda12
    has_mpi || extras=$extras,mpich
    python -m pip install -q -e ".[$extras]"
fi
python -m cupycomm.run.launchers   # which launcher the passes use, and its version

status=0
run() {
    echo "+ $*"
    "$@" || status=$?
}
read -r -d '' -a tests <<< "${TESTS:-tests}" || true   # words, across lines
sizes=${RANKS:-1 2 3 4}
unset RANKS TESTS   # ours, not the tests' (benchmarks/run_matrix reads a RANKS of its own)
# A hard bound on each pass on top of the plugin's per-test timeout: nothing can hang CI
# (SIGKILL 60 s after the SIGTERM, should anything take no notice of it).
for n in $sizes; do
    if [ -n "${UNDER_MPIEXEC:-}" ]; then
        # As users run their suites: the launcher (with the options it needs) and pytest, no
        # cupycomm.run; at one rank too, where the plugin starts no jobs of its own.
        eval "launch=($(python -m cupycomm.run.launchers -n "$n"))"
        run timeout -k 60 900 "${launch[@]}" python -m pytest --color=no "${tests[@]}" "$@"
        continue
    fi
    if [ "$n" = 1 ]; then
        # isolated mode off: the mpiexec passes below run the other sizes
        run timeout -k 60 900 python -m pytest --mpi-isolated=no "${tests[@]}" "$@"
        continue
    fi
    # cupycomm.run starts the environment's launcher with the options that leave ending a
    # failed job to cupycomm (hydra kills every rank itself when one exits without
    # MPI_Finalize and may then exit 0), and exits non-zero, naming the rank, whenever a rank
    # ended without finishing, whatever the launcher says.
    # No colour: Open MPI gives its ranks a terminal, and CI reads the closing line as text.
    run timeout -k 60 900 python -m cupycomm.run -n "$n" -m pytest --color=no "${tests[@]}" "$@"
done
exit "$status"
