"""Tests that run in the test process: no rank processes of their own (``scripts/test.sh --quick`` runs these)."""
