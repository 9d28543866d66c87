"""Generated protobuf and gRPC code of the dsec contracts (scripts/gen-protos.sh). Do not edit."""
