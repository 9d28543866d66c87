"""python -m edge"""

from common.grpc_server import run_service
from edge.server import main

run_service(main)
