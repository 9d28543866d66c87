"""python -m compat"""

import common.grpc_engine  # noqa: F401  (first: it sets up gRPC before grpc loads)

# isort: split

from common.grpc_server import run_service
from compat.server import main

run_service(main)
