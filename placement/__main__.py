"""python -m placement"""

from common.grpc_server import run_service
from placement.server import main

run_service(main)
