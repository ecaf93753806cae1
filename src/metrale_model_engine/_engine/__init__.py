"""The engine: ``EpLink`` and its parts, one room per path: ``settings`` (checked once; the setup exchange),
``run_state`` (the stream's count, the link's one state, whose stop closes the link, the forward's scope), the
head's ``sender`` and ``sync`` (with the pure ``agreement``), the worker's ``reader``, ``roles`` (the head's and a
worker's, chosen once), ``forward`` (a forward's collectives) and ``link``; ``way_back``, what comes back from the
workers: the worker's side of it, the head's ``reports`` and ``answers`` (decoded for both of the head's readers);
``reform``, the link formed again over the ranks left.  Speaks to any transport through the protocol of
``_core.transport``; imports no backend."""
