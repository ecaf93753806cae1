"""Processes of this host: which peers are alive (pidfds, host fingerprints) and running N ranks."""
