#!/usr/bin/env bash
# Run the whole test suite in a fresh virtual environment.
#
#   ./scripts/test.sh                    # with the default python3
#   PYTHON=python3.12 ./scripts/test.sh  # with another interpreter
#
# Torch: METRALE_TEST_TORCH=1 installs the CPU build torch==2.13.0 first and runs the
# multi-rank tests and mypy --strict on src and tests; =0 skips them (the torch tests
# then report as skipped).  The default, auto, means 1 on Python 3.11 (the CPU wheel
# this project's machines keep on disk) and 0 elsewhere, so that no multi-GB CUDA
# build is ever downloaded by accident.  Exits non-zero on the first failure.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv=${VENV:-"$root/.venv-$version"}
with_torch=${METRALE_TEST_TORCH:-auto}
if [ "$with_torch" = auto ]; then
    [ "$version" = 3.11 ] && with_torch=1 || with_torch=0
fi

echo "== Python $version ($("$python" -c 'import sys; print(sys.executable)')), torch tests: $with_torch, venv: $venv"
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
extras=test
if [ "$with_torch" = 1 ]; then
    "${pip[@]}" torch==2.13.0
    extras=test,torch
fi
"${pip[@]}" -e "$root[$extras]"

cd "$root"
"$venv/bin/python" -m pytest
if [ "$with_torch" = 1 ]; then
    "$venv/bin/python" -m mypy --strict
fi
echo "== Python $version: all checks passed"
