"""Tools and rewards off the orchestrator's loop: a process sandbox for model-written code
(`sandbox.py`, set up by `launcher.py`), the bundled tools (`calculator.py`, `registry.py`)
and a bounded worker pool (`pool.py`); their config is config/tools.py, and tool ranks are
ranks/tool_ranks.py. docs/tools.md says what the sandbox guarantees.
"""
