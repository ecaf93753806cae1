"""A program's ``argv`` run in this process as ``python`` would run it: ``-m MODULE ARGS``, ``-c CODE ARGS`` or
``SCRIPT ARGS`` as ``__main__``, with the ``sys.argv`` and ``sys.path`` a fresh start gives it.

For the processes that fork programs from one import of torch: the program server's children
(``helpers.program_server``) and a simulated host's ranks (``helpers.host_launch``).  Imported by the
program server at its start, so that ``SITE`` is that fresh interpreter's own.
"""

from __future__ import annotations

import os
import runpy
import sys
import types


def _python_path() -> list[str]:
    return [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]


SITE = [entry for entry in sys.path[1:] if entry not in _python_path()]
"""The importing interpreter's ``sys.path`` but its own first entry and ``PYTHONPATH``: what every program's path
ends with."""


def run_as_main(argv: list[str]) -> None:
    """Run ``argv`` (the interpreter left out) as ``python`` would; its ``SystemExit`` ends this process."""
    python_path = [os.path.abspath(entry) for entry in _python_path()]  # as site makes them
    site = [entry for entry in SITE if entry not in python_path]
    if argv[0] == "-c":
        sys.path[:] = ["", *python_path, *site]
        sys.argv = ["-c", *argv[2:]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec", dont_inherit=True), main.__dict__)  # as python -c runs it
    elif argv[0] == "-m":
        sys.path[:] = [os.getcwd(), *python_path, *site]
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.path[:] = [os.path.dirname(script), *python_path, *site]
        sys.argv = list(argv)
        runpy.run_path(script, run_name="__main__")
