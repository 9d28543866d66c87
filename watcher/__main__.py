"""python -m watcher"""

from common.grpc_server import run_service
from watcher.server import main

run_service(main)
