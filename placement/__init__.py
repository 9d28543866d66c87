"""Placement: power-of-k edge choice over the watcher's snapshot plus this instance's own overlay."""
