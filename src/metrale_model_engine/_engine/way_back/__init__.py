"""The way back from the workers to the head: ``worker`` (``WorkerWayBack``: a worker's reports, refusals and
acknowledgements), ``answers`` (what comes back, decoded; pure) and ``reports`` (``WorkerReports``: the head's view
of its workers, their reports, which exited and how).  The head's sync points read it from ``_engine.sync``."""
