#!/usr/bin/env bash
# The test command: ruff lint and format, pytest, mypy --strict and basedpyright
# --verifytypes (100% required; without torch, 100% outside the torch-only reference
# package: scripts/verify_types.py), then, where the docs extra is installed (with
# torch), `mkdocs build --strict`, in the environment .venv-X.Y.
#
#   ./scripts/test.sh                    # everything, with the default python3
#   ./scripts/test.sh --quick            # everything but the tests that start processes (marker `ranks`)
#   ./scripts/test.sh --fresh            # rebuild the environment first (what CI does)
#   ./scripts/test.sh -- -k shm -x       # arguments after -- go to pytest
#   PYTHON=python3.12 ./scripts/test.sh  # with another interpreter
#   METRALE_TEST_WORKERS=0 ./scripts/test.sh   # pytest in one process (default: 3 workers, pytest-xdist)
#   VENV=/tmp/env ./scripts/test.sh      # the environment elsewhere (a directory that is not
#                                        # a virtual environment is refused, never removed)
#
# The environment is built with uv (from PyPI; installed into .venv-tools when it is
# not on PATH) and reused as long as its inputs are unchanged: the interpreter, the
# torch choice, pyproject.toml, uv's version and this script.  The package is
# installed editable, so changes to the sources need no rebuild.
#
# Torch: METRALE_TEST_TORCH=1 installs the CPU build torch==2.13.0 and runs the
# multi-rank tests and mypy --strict on src and tests; =0 skips them (the torch tests
# then report as skipped).  The default, auto, means 1 on Python 3.11 and 0 elsewhere.
# The CPU build comes from the directory pip's configuration names in find-links when
# it holds the wheel for this interpreter (this project's machines keep it there),
# else from PyPI's torch CPU index (https://download.pytorch.org/whl/cpu): never the
# multi-GB CUDA build.  Exits non-zero on the first failure.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fresh=0
markers=()
pytest_args=()
while [ $# -gt 0 ]; do
    case $1 in
        --quick) markers=(-m "not ranks") ;;
        --fresh) fresh=1 ;;
        --) shift; pytest_args=("$@"); break ;;
        *) echo "scripts/test.sh: unknown argument '$1' (accepted: --quick, --fresh, -- PYTEST_ARGS...)" >&2; exit 2 ;;
    esac
    shift
done

python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv=${VENV:-"$root/.venv-$version"}
with_torch=${METRALE_TEST_TORCH:-auto}
if [ "$with_torch" = auto ]; then
    [ "$version" = 3.11 ] && with_torch=1 || with_torch=0
fi

# uv: from PATH, else from .venv-tools (made once with the standard library's venv and pip).
if command -v uv >/dev/null 2>&1; then
    uv=$(command -v uv)
else
    uv="$root/.venv-tools/bin/uv"
    if [ ! -x "$uv" ]; then
        echo "== installing uv from PyPI into $root/.venv-tools"
        "$python" -m venv "$root/.venv-tools"
        "$root/.venv-tools/bin/python" -m pip install --quiet --disable-pip-version-check 'uv>=0.5'
    fi
fi

# The CPU build of torch==2.13.0 for this interpreter: the wheel in a find-links directory of pip's
# configuration (uv reads none of it), else PyTorch's CPU index.
torch_source=()
if [ "$with_torch" = 1 ]; then
    tag=$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
    links=${PIP_FIND_LINKS:-$("$python" -m pip config get global.find-links 2>/dev/null ||
        "$python" -m pip config get install.find-links 2>/dev/null || true)}
    for dir in $links; do
        for wheel in "${dir#file://}"/torch-2.13.0+cpu-"$tag"-"$tag"-*.whl; do
            [ -f "$wheel" ] && [ ${#torch_source[@]} = 0 ] && torch_source=("$wheel")
        done
    done
    [ ${#torch_source[@]} = 0 ] && torch_source=(torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)
fi
extras=test
[ "$with_torch" = 1 ] && extras=test,torch,test-torch,bench,docs,serve
inputs=$(
    {
        "$python" -c 'import sys; print(sys.executable, sys.version)'
        echo "torch: ${torch_source[*]-none}"
        "$uv" --version
        cat "$root/pyproject.toml" "$root/scripts/test.sh"
    } | "$python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
)
stamp="$venv/.test-inputs"

echo "== Python $version ($python), torch tests: $with_torch, venv: $venv"
if [ "$fresh" = 0 ] && [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ]; then
    echo "== reusing $venv (its inputs are unchanged; --fresh rebuilds it)"
else
    if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
        echo "scripts/test.sh: $venv exists and is not a virtual environment; not replacing it" >&2
        exit 2
    fi
    started=$SECONDS
    rm -rf "$venv"
    "$uv" venv --quiet --python "$python" "$venv"
    # Compiled now, since a machine may forbid writing .pyc at import (PYTHONDONTWRITEBYTECODE, as
    # ours do): every spawned rank imports torch, which takes twice as long from source.
    install=("$uv" pip install --quiet --compile-bytecode --python "$venv/bin/python")
    if [ "$with_torch" = 1 ]; then
        "${install[@]}" "${torch_source[@]}"
    fi
    "${install[@]}" -e "$root[$extras]"
    echo "$inputs" >"$stamp"
    echo "== built $venv in $((SECONDS - started)) s"
fi

cd "$root"
echo "== ruff (lint, format)"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
# pytest's workers (pytest-xdist): tests that share a module's fixture stay on one worker, the tests marked
# serial run first, apart, beside the light and the in-process ones, and at most two tests that load the machine
# run at once (tests/conftest.py, tests/helpers/serial.py); 0: every test in this one process, in the tiers' order.
workers=${METRALE_TEST_WORKERS:-3}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
# Bytecode cached under the environment, even where the machine forbids writing it beside the sources
# (PYTHONDONTWRITEBYTECODE): each worker, and each program a test starts, would compile the tests (pytest
# rewrites their asserts: seconds of CPU each) and the package anew.
echo "== pytest ${parallel[*]-} ${markers[*]-} ${pytest_args[*]-}"
PYTHONDONTWRITEBYTECODE='' PYTHONPYCACHEPREFIX="$venv/pycache" "$venv/bin/python" -m pytest \
    ${parallel[@]+"${parallel[@]}"} ${markers[@]+"${markers[@]}"} ${pytest_args[@]+"${pytest_args[@]}"}
echo "== mypy --strict"
if [ "$with_torch" = 1 ]; then
    "$venv/bin/python" -m mypy --strict  # src, tests, examples, benchmarks and scripts (pyproject)
else
    # Without torch: the core (every module that imports neither torch nor another optional package, at the
    # top or one indent in, as under TYPE_CHECKING, nor a module that does), its tests and the torch-free
    # example; the rest is followed silently (its own run is the one with torch).  The reference model and
    # the HTTP server (reference/, serve/) need torch whole.
    optional='torch|numpy|safetensors|tokenizers|transformers|openai|httpx|fastapi|starlette|uvicorn|prometheus_client|jinja2'
    torch_free=()
    while IFS= read -r file; do
        grep -qE "^(    )?(import|from) ($optional)\b|^from \.+(_torch|_launch|_tensors|torch)(\.[a-z_]+)? import" \
            "$file" || torch_free+=("$file")
    done < <(find src/metrale_model_engine -name '*.py' -not -path '*/reference/*' -not -path '*/serve/*' | sort)
    while IFS= read -r file; do
        grep -qE "^(    )?(import|from) ($optional)\b|^from metrale_model_engine.torch|importorskip\(\"torch\"" "$file" ||
            torch_free+=("$file")
    done < <(find tests examples -name '*.py' | sort)
    "$venv/bin/python" -m mypy --strict --follow-imports=silent "${torch_free[@]}"
fi
echo "== basedpyright --verifytypes (type completeness of the public API must be 100%)"
"$venv/bin/python" scripts/verify_types.py
if [ -x "$venv/bin/mkdocs" ]; then  # the docs extra: installed with torch (on 3.11 by default)
    echo "== mkdocs build --strict (docs/ and the API reference from the docstrings; warnings fail)"
    NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --quiet --site-dir "$venv/site"
fi
echo "== Python $version: all checks passed"
