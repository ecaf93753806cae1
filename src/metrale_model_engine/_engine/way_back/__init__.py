"""The way back from the workers to the head: ``worker`` (``WorkerWayBack``: a worker's reports, refusals and
acknowledgements), ``answers`` (what comes back, decoded; pure) and ``reports`` (``WorkerReports``: the head's view
of its workers, their reports, which exited and how).  Used by the head's ``sender`` and ``roles`` and its sync
points (``_engine.sync``)."""
