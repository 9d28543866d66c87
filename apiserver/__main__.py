"""python -m apiserver"""

import common.grpc_engine  # noqa: F401  (first: it sets up gRPC before grpc loads)

# isort: split

from apiserver.server import main
from common.grpc_server import run_service

run_service(main)
