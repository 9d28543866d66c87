"""libdsec: the Python SDK of dsec, an elastic sandbox platform for agentic RL.

    from libdsec import Client, NetworkPolicy

    with Client() as dsec:                       # the local cluster (`dsec up`) by default
        with dsec.create(image="bookworm", cpu=1, memory_mb=1024, idle_timeout_s=300) as sb:
            r = sb.run("python3 -c 'print(6*7)'")
            print(r.exit_code, r.text)

Errors are classes of :mod:`libdsec.errors` (root :class:`DSecError`), each
bound to one gRPC status code and a stable ``reason``.
"""

from libdsec._oplog import Operation, ReplayReport, ReplayStep
from libdsec.aio import (
    AsyncClient,
    AsyncDirWatch,
    AsyncDisplay,
    AsyncFiles,
    AsyncProcess,
    AsyncSandbox,
    AsyncSession,
    AsyncWatch,
)
from libdsec.errors import DSecError
from libdsec.options import CreateOptions, SandboxOptions
from libdsec.sync import Client, DirWatch, Display, Files, Process, Sandbox, Session, Watch
from libdsec.types import (
    CompileInfo,
    Environment,
    ExecInfo,
    ExecResult,
    Exited,
    ExitStatus,
    FileEvent,
    FileInfo,
    ForkResult,
    FunctionJob,
    FunctionResult,
    HttpResponse,
    Layer,
    MemoryInfo,
    ModifiedFile,
    NetworkPolicy,
    NewToken,
    Output,
    Principal,
    Project,
    Quota,
    SandboxInfo,
    SandboxMetric,
    SandboxSpecInfo,
    Started,
    TaskEdgeError,
    TaskResult,
    TaskSandboxResult,
    TokenInfo,
    Violations,
)

__all__ = [
    "AsyncClient",
    "AsyncDirWatch",
    "AsyncDisplay",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSession",
    "AsyncWatch",
    "Client",
    "CompileInfo",
    "CreateOptions",
    "DSecError",
    "DirWatch",
    "Display",
    "Environment",
    "ExecInfo",
    "ExecResult",
    "ExitStatus",
    "Exited",
    "FileEvent",
    "FileInfo",
    "Files",
    "ForkResult",
    "FunctionJob",
    "FunctionResult",
    "HttpResponse",
    "Layer",
    "MemoryInfo",
    "ModifiedFile",
    "NetworkPolicy",
    "NewToken",
    "Operation",
    "Output",
    "Principal",
    "Process",
    "Project",
    "Quota",
    "ReplayReport",
    "ReplayStep",
    "Sandbox",
    "SandboxInfo",
    "SandboxMetric",
    "SandboxOptions",
    "SandboxSpecInfo",
    "Session",
    "Started",
    "TaskEdgeError",
    "TaskResult",
    "TaskSandboxResult",
    "TokenInfo",
    "Violations",
    "Watch",
]
