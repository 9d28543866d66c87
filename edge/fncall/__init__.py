"""FnCall: warm pools of pre-created runc containers for short stateless jobs.

`service.FnCallService` (pools, jobs, batches, compile-once) is the edge's entry point;
`runner.py` (with `runner_spares.py`, `runner_job.py`, `runner_files.py` and `wire.py`) is
the in-container side, standard library only. See
docs/ARCHITECTURE.md, "FnCall".
"""
