"""Watcher: probes every edge, keeps health and sandbox counts for placement. No durable state."""
