#!/usr/bin/env bash
# Build the documentation site into docs/_build/html, warnings as errors (a broken
# cross-reference, a docstring that does not render, a public name missing from the
# reference fail the build). Installs the docs extra into the active virtual environment,
# else into .venv (made if missing), with MPICH's wheel only where there is no MPI (no
# mpiexec, no $MPIEXEC): autodoc imports mpi4py, which needs a library.
#
#   bash docs/build.sh                 # then open docs/_build/html/index.html
#   bash docs/build.sh -E              # extra arguments go to sphinx-build (-E: every page anew)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
extras=docs
if [ -z "${MPIEXEC:-}" ] && ! command -v mpiexec >/dev/null; then
    extras=$extras,mpich
fi
python -m pip install -q -e ".[$extras]"
start=$SECONDS
python -m sphinx -W --keep-going -n -q -b html "$@" docs docs/_build/html
echo "docs: built docs/_build/html in $((SECONDS - start)) s"
