"""python -m iam"""

from common.grpc_server import run_service
from iam.server import main

run_service(main)
