"""What runs on the ranks of a job: worker loops, typed messages and the transports that carry them,
non-spinning MPI waits, the doorbell, liveness (a dead rank ends the job), weight sync, state swap, device choice, timing."""
