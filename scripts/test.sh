#!/usr/bin/env bash
# Run the whole test suite in a fresh virtual environment: ruff lint and format,
# pytest, mypy --strict and basedpyright --verifytypes (100% required; without torch,
# 100% outside the torch-only reference package: scripts/verify_types.py).
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
    extras=test,torch,bench
fi
"${pip[@]}" -e "$root[$extras]"

cd "$root"
echo "== ruff (lint, format)"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
echo "== pytest"
"$venv/bin/python" -m pytest
echo "== mypy --strict"
if [ "$with_torch" = 1 ]; then
    "$venv/bin/python" -m mypy --strict  # src, tests, examples, benchmarks and scripts (pyproject)
else
    # Without torch: the core (every module that imports neither torch nor a module that does), its tests
    # and the torch-free example; modules that need torch are followed silently (their own run is the one
    # with torch).
    torch_free=()
    for file in src/metrale_model_engine/*.py; do
        grep -qE "^(import torch|from torch)|^    import torch|^from \.(_torch_transport|_groups|_choice|torch) import" \
            "$file" || torch_free+=("$file")
    done
    for file in tests/*.py examples/*.py; do
        grep -qE "^(import torch|from metrale_model_engine.torch|    import torch)|importorskip\(\"torch\"" "$file" || torch_free+=("$file")
    done
    "$venv/bin/python" -m mypy --strict --follow-imports=silent "${torch_free[@]}"
fi
echo "== basedpyright --verifytypes (type completeness of the public API must be 100%)"
"$venv/bin/python" scripts/verify_types.py
echo "== Python $version: all checks passed"
