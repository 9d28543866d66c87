"""API server: the stateless public front door (auth, create flow, routing to edges)."""
