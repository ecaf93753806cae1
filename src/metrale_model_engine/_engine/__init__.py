"""The engine: ``EpLink`` and its parts, one room per path: ``settings`` (checked once; the setup exchange),
``run_state`` (the stream's count, the link's one state, whose stop closes the link, the forward's scope), the
head's ``sender``, ``reports`` and ``sync`` (with the pure ``agreement``), the worker's ``reader`` and
``way_back``, ``answers`` (decoded for both of the head's readers), ``roles`` (the head's and a worker's, chosen
once), ``forward`` (a forward's collectives) and ``link``.  Speaks to any transport through the protocol of
``_core.transport``; imports no backend."""
