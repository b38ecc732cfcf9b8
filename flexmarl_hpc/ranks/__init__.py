"""The ranks of a job, wired: the config turned into engines, trainers and tasks
(`build.py`), the worker loops of replica and trainer ranks (`workers.py`) and the tool
ranks with their client (`tool_ranks.py`). It sits above `runtime/` (the parts these loops
are made of) and beside `orchestrator/` (rank 0's loop); run.py starts them.
"""
