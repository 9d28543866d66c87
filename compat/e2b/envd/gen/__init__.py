"""Generated code of E2B's envd contracts (protos/e2b, scripts/gen-protos.sh). Do not edit."""
