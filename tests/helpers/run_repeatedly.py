"""Run one rank of a torchrun-style program several times, importing torch once.

``python tests/helpers/run_repeatedly.py SCRIPT`` with torchrun's variables set
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``) and ``METRALE_TEST_PORTS``, one port per
attempt, comma-separated.  Each attempt forks a child that runs ``SCRIPT`` as
``__main__`` with ``MASTER_PORT`` set to its port and ``METRALE_EP_PROTOCOL`` to v2
then v1 by turns, and that ends as a program started afresh ends: through the
interpreter's own exit (atexit hooks, then the teardown of every module), which is
what a clean exit is about.  Only torch's import (about a second each) is shared, and
its objects are frozen out of the garbage collector (``gc.freeze``) before the forks:
each child's collections, its exit's included, then skip the objects it shares with
this process instead of copying their pages (half a second of CPU an exit).  What the
script makes (its process group, its link, the library and its exit hook, imported
by the child) is collected and torn down as in a fresh program.
After each child this process prints ``attempt K: exit CODE``; the child's own
output comes before that line.  It stops at the first attempt that does not exit 0.
"""

import gc
import os
import runpy
import sys

import torch.distributed  # noqa: F401  (imported once, before the forks: the second a fresh start spends)

gc.freeze()  # torch's objects: shared with every child, never collected in one

script = sys.argv[1]
for attempt, port in enumerate(os.environ["METRALE_TEST_PORTS"].split(",")):
    os.environ["MASTER_PORT"] = port
    os.environ["METRALE_EP_PROTOCOL"] = "v1" if attempt % 2 else "v2"
    sys.stdout.flush()  # nothing buffered here may be written twice, once by the child
    child = os.fork()
    if child == 0:
        sys.argv = [script]
        runpy.run_path(script, run_name="__main__")
        raise SystemExit(0)  # ends the child like a program whose script ran to its end
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    print(f"attempt {attempt}: exit {code}", flush=True)
    if code != 0:
        raise SystemExit(1)
