"""Server-side code shared by every dsec service: configuration, the run loop,
error mapping at the gRPC boundary, telemetry and logging, outbound channels.

Nothing here is imported by libdsec (the SDK ships alone)."""
