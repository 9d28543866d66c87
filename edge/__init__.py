"""Edge: the per-node agent (admission, runtime, TTL/idle, forwarding into sandboxes)."""
