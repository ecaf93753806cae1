"""The engine: ``EpLink`` and its parts (settings, the setup exchange, the command stream, the run's
state, the worker's reader, the head's sender and view of its workers' reports, sync points), the
``ModelEp`` trait, ``LinkedEp`` and ``run_worker``.  Speaks to any transport through the protocol of
``_core.transport``; imports no backend."""
