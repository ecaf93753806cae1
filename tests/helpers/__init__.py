"""What the test modules share, and nothing else: helpers are imported from here, never from a test module.

* :mod:`.fakes`: ``FakeTransport``, the one pretend transport with fault injection
  (a :class:`~metrale_model_engine.testing.RecordingTransport` that also plays a worker);
* :mod:`.messages`: the words of wire messages, built by hand;
* :mod:`.rank_results`: what a rank process hands back to its test;
* ``*_sessions`` and :mod:`.shm_programs`: the bodies of rank processes (module-level
  functions, so that the start server can run them by name);
* ``exit_without_teardown.py``: a program run as a user runs it.
"""
