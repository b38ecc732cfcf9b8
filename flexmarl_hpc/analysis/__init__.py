"""Reading a run after the fact: its HDF5 file as pandas DataFrames.

    from flexmarl_hpc.analysis import load_run, summary
"""
from flexmarl_hpc.analysis.load import load_run, summary  # noqa: F401  (the notebook API)
