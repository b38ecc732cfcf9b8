"""Imported only inside multiprocessing's forkserver (lifeline.forkserver_context names it as
the server's preload): it ties the server to the rank that spawned it. Importing it
anywhere else would tie that process to its parent, or end it."""
import os

from flexmarl_hpc.tools import lifeline

lifeline.die_with_parent(int(os.environ[lifeline.OWNER]))
lifeline.server_pid = os.getpid()
