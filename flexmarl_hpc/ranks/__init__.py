"""The ranks of a job, wired: each rank's role, device and start-up (`job.py`), the config
turned into engines, trainers and the state mover (`build.py`), the worker loops of replica
and trainer ranks (`workers.py`) and the tool ranks with their client (`tool_ranks.py`).
It sits above `runtime/` (the parts these loops are made of) and `orchestrator/` (rank 0's
loop, which job.py starts); run.py, the CLI, starts the ranks.
"""
