"""Tests that start rank processes, forked from the start server (``tests/conftest.py``)."""
