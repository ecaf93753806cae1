"""Tests that run the demo, the examples and torchrun as a user does: fresh interpreters that import torch."""
