"""python -m apiserver"""

from apiserver.server import main
from common.grpc_server import run_service

run_service(main)
