"""What the test modules share, and nothing else: helpers are imported from here, never from a test module.

* :mod:`.fakes`: ``FakeTransport``, the one pretend transport with fault injection
  (a :class:`~metrale_model_engine.testing.RecordingTransport` that also plays a worker);
* :mod:`.messages`: the words of wire messages, built by hand;
* :mod:`.rank_results`: what a rank process hands back to its test;
* ``*_sessions`` and :mod:`.shm_programs`: the bodies of rank processes (module-level
  functions, so that the start server can run them by name);
* :mod:`.demo_env`: the demo started by hand in the test process;
* :mod:`.greedy`: the reference model's greedy run that one rank and a sharded group compare;
* ``exit_without_teardown.py``: a program run as a user runs it; ``run_repeatedly.py``: a
  torchrun-style program run several times from one import of torch;
* :mod:`.programs`: ``Popen`` and ``run`` of a program forked from :mod:`.program_server`, which
  imported torch once; :mod:`.as_main`, a program's ``argv`` run as ``__main__``; :mod:`.isolation`,
  the namespaces of a simulated host (:mod:`.hosts`) entered from Python.
"""
