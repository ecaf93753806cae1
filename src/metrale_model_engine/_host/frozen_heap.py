"""Imported last by the start server of ``start_ranks_from_a_server``, for its side effect: ``gc.freeze()``.

A rank forked from the server imports its target's module before any code of ours
runs in it (the start method unpickles the target first).  Were the server's objects
(torch's among them) still in its garbage collector, the collections of that import
would walk them and write to their pages, copying them: about 0.1 s of CPU and
9,000 page faults a rank on this project's machine.  Frozen here, once, they are
never collected in a rank.
"""

import gc

gc.freeze()
