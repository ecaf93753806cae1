"""Tests that run the demo, the server, the examples and torchrun as a user does, as processes of their own (most
forked from the program server, ``helpers.programs``; a few started afresh)."""
