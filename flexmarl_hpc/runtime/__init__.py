"""The parts ranks are made of: typed messages and the transports that carry them,
non-spinning MPI waits, the doorbell, liveness (a dead rank ends the job), weight sync, state
swap, device choice, timing. The loops that use them are in ranks/."""
