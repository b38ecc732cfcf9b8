"""One rank of a job, wired: the run lock taken collectively, the rank's role from the layout,
its device, engine or trainers, the orchestrator on rank 0, the tool ranks, and the exit code
a failure ends in (docs/reliability.md). `python -m flexmarl_hpc.run` (run.py: the CLI, the
pre-launch checks and the mpiexec relaunch) calls `hold_run_lock` and `run_rank` on every
rank once it runs under MPI.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from flexmarl_hpc.config.layout import ORCHESTRATOR, ROLLOUT, TOOLS, RankLayout, check_world
from flexmarl_hpc.config.load import save_config, to_dict
from flexmarl_hpc.config.plan import Plan
from flexmarl_hpc.config.schema import Config, ConfigError
from flexmarl_hpc.runtime import requeue
from flexmarl_hpc.runtime.requeue import EXIT_REQUEUE
from flexmarl_hpc.store.checkpoint import CheckpointError
from flexmarl_hpc.store.checksum import StoreDamaged, StoreInconsistent, StoreUnreadable
from flexmarl_hpc.store.lock import RunLock, acquire, drop_inherited, empty_record, launched_by_holder
from flexmarl_hpc.store.tables import StoreError


_LOCK: RunLock | None = None          # rank 0's lock on run.output_dir, held until the process ends


def hold_run_lock(cfg: Config) -> bool:
    """Every rank (collective): rank 0 takes run.output_dir's lock; False on every rank if
    another run holds it (rank 0 says who, in one line; the others stay silent). Under
    Slurm nothing checked before srun started the ranks, so this is the check there."""
    global _LOCK
    import atexit
    from flexmarl_hpc import faults
    from flexmarl_hpc.runtime.stale_shm import clear_stale_segments
    drop_inherited(cfg.output_dir)                 # the launcher's lock: mpiexec's alone
    stale = clear_stale_segments()                 # else a requeued job hangs in MPI_Init
    if stale:
        print(f"flexmarl_hpc: removed {len(stale)} MPICH shared-memory segment(s) an earlier incarnation "
              f"of this step left in /dev/shm ({', '.join(stale)})", file=sys.stderr, flush=True)
    faults.hit("mpi_start")                        # test-only: a rank hung before MPI_Init
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    refused = None
    if world.Get_rank() == 0:
        try:
            _LOCK = acquire(cfg.output_dir, lambda line: print(line, file=sys.stderr, flush=True))
            atexit.register(_LOCK.release)
        except ConfigError as e:
            if launched_by_holder(cfg.output_dir):     # our launcher took it (store/lock.py)
                atexit.register(empty_record, cfg.output_dir)
            else:
                refused = str(e)
    refused = world.bcast(refused, root=0)
    if refused and world.Get_rank() == 0:
        print(f"config error: {refused}", file=sys.stderr, flush=True)
    started = os.environ.get("FLEXMARL_STARTED_FILE")
    if started and world.Get_rank() == 0 and refused is None:
        Path(started).touch()                      # every rank is through MPI start-up: the
    return refused is None                         # batch script's watchdog stands down


def run_rank(plan: Plan) -> int:
    from mpi4py import MPI
    from flexmarl_hpc.runtime.comm import abort
    world = MPI.COMM_WORLD
    try:
        check_world(plan.layout, world.Get_size())
        code = _run_rank(plan, world)
        # the run is over (checkpointed, store closed): a late SIGTERM/SIGUSR1 from Slurm must
        # not turn a clean exit into 143 while the interpreter shuts down
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        return code
    # a rank's fatal error ends the job, after comm.abort's grace: without it mpiexec may
    # end the job before its proxy forwarded the rank's last line (seen in CI). Ranks still
    # running meanwhile may fail too (a second checkpoint writer on the same full disk); each
    # reports its own error
    # a full disk, or a store found damaged when the orchestrator re-opens it (damaged after
    # the pre-launch check): one line naming the path, not a traceback
    except (CheckpointError, StoreError, StoreDamaged, StoreUnreadable, StoreInconsistent) as e:
        what = "checkpoint" if isinstance(e, CheckpointError) else "store"
        code = exit_code(e)
        sys.stderr.write(f"[rank {world.Get_rank()}] {what} error: {e}"
                         + (f" (exiting {code}: free space, then the same command resumes)\n"
                            if code == EXIT_REQUEUE else "\n"))
        (requeue.mark if code == EXIT_REQUEUE else requeue.mark_error)(f"{what} error: {e}")
        abort(world, code)
        return code
    except BaseException as e:
        sys.stderr.write(f"[rank {world.Get_rank()}] fatal error:\n{traceback.format_exc()}")
        requeue.mark_error(f"rank {world.Get_rank()}: {type(e).__name__}: {e}")
        abort(world, 1)
        return 1


def exit_code(e: Exception) -> int:
    """The job's exit code for a checkpoint or store error: EXIT_REQUEUE where the same
    command succeeds once someone fixes the cause (a full disk or quota: the writes were
    journaled, a resume discards what was not committed), 1 otherwise; a store found
    damaged (StoreDamaged, StoreUnreadable) stays 1, as a requeue would find it damaged again."""
    full = isinstance(e, (CheckpointError, StoreError)) and e.errno in (errno.ENOSPC, errno.EDQUOT)
    return EXIT_REQUEUE if full else 1


_PREEMPTED = False


def _on_signal(signum, frame) -> None:
    global _PREEMPTED
    _PREEMPTED = True


def _run_rank(plan: Plan, world) -> int:
    import torch
    cfg, layout = plan.cfg, plan.layout
    t0 = time.monotonic()                       # start-up's build phase begins (run.build_timeout_s)
    from flexmarl_hpc.ranks.build import build_engine, build_mover
    from flexmarl_hpc.workflows.build import build_task
    torch.set_num_threads(cfg.run.threads_per_rank)
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, _on_signal)          # every rank: the orchestrator decides what to do
    rank = world.Get_rank()
    role, index = layout.role_of(rank)
    role_comm = world.Split(layout.split_color(rank), rank)
    # every rank (collective): each replica and trainer rank gets GPUs of its own, before
    # any engine or trainer touches CUDA; 'cpu' on nodes without GPUs
    from flexmarl_hpc.runtime.devices import bind_rank
    device = bind_rank(world, layout, tuple(p.gpus_per_replica for p in plan.pools)).device
    task = None if role == TOOLS else build_task(cfg)
    out = cfg.output_dir
    bucket = int(cfg.weight_sync.bucket_mb * 2**20)
    bell = _doorbell(cfg, world)
    live = _liveness(world)
    if role == TOOLS:
        return _serve_tools(cfg, world, live, t0)
    if role == ORCHESTRATOR:
        return _orchestrate(plan, world, task, bell, live, t0)
    if role == ROLLOUT:
        from flexmarl_hpc.learn.sampling import SamplingParams
        from flexmarl_hpc.ranks.workers import replica_loop
        from flexmarl_hpc.ranks.workers import replica_channels
        engine = build_engine(plan, task, device, layout.pool_of(index))
        engine.start()                          # vLLM builds its engines now, not in the first sync group
        params = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p)
        channels = _started(cfg, world, live, t0, lambda setup: replica_channels(
            world, engine, cfg.weight_sync.backend, cfg.weight_sync.timeout_s, plan.sync_groups, setup))
        return replica_loop(world, 0, index, engine, params, bucket, cfg.weight_sync.backend, bell, live,
                            cfg.weight_sync.timeout_s, plan.sync_groups, channels)
    from flexmarl_hpc.ranks.workers import restore_trainers, trainer_channels, trainer_loop
    mover = build_mover(plan, task, world, index, role_comm, device)
    if cfg.run.resume:
        restore_trainers(role_comm, mover, out / "checkpoints")
    from flexmarl_hpc.runtime.weight_sync import wire_dtype
    wire = wire_dtype(cfg.rollout.dtype, cfg.rollout.backend, cfg.weight_sync.backend)
    channels = _started(cfg, world, live, t0, lambda setup: trainer_channels(
        world, cfg.weight_sync.backend, cfg.weight_sync.timeout_s, plan.sync_groups, setup))
    return trainer_loop(world, role_comm, 0, mover, out / "checkpoints", bucket, cfg.run.keep_checkpoints,
                        cfg.weight_sync.backend, wire, bell, live, cfg.weight_sync.timeout_s,
                        plan.sync_groups, channels)


def _serve_tools(cfg: Config, world, live, t0: float) -> int:
    """A tool rank (tools.ranks > 0): its own pool of sandboxes and reward workers, serving
    rank 0's episodes (flexmarl_hpc/ranks/tool_ranks.py) until the Stop."""
    from flexmarl_hpc.tools.pool import WorkerPool
    from flexmarl_hpc.tools.registry import Tools
    from flexmarl_hpc.ranks.tool_ranks import tools_loop
    pool = WorkerPool(Tools.from_config(cfg.tools), cfg.tools)
    _started(cfg, world, live, t0)
    return tools_loop(world, 0, pool, live)


def _started(cfg: Config, world, live, t0: float, open_comms=None, log=None, who=str):
    """Every rank (collective), once built: start-up's two phases (runtime/startup.py), each
    with its own deadline and measured on every rank, rank 0 (`log`) writing both to
    train.log. "build" (run.build_timeout_s from `t0`): every engine and trainer built;
    "comm" (run.comm_setup_timeout_s): `open_comms(setup deadline)` makes this rank's
    weight-sync communicators (workers; its result is returned). The orchestrator sends its
    first command after both, so neither run.worker_timeout nor a sync's weight_sync.timeout_s
    counts another rank's start-up. A phase past its deadline ends the job (exit 1, naming
    the field); a worker that ends meanwhile ends it with 75."""
    from flexmarl_hpc.runtime import startup
    from flexmarl_hpc.runtime.deadline import CollectiveTimeout, Deadline
    from flexmarl_hpc import faults
    busy = open_comms is not None              # the orchestrator and tool ranks build nothing here
    if busy:
        faults.hit("build")                    # test-only: no-op unless FLEXMARL_FAULT is set
    try:
        startup.started(world, live, "build", time.monotonic() - t0 if busy else 0.0, cfg.run.build_timeout_s,
                        t0, log, who, lambda: _PREEMPTED)
        t1 = time.monotonic()
        setup = Deadline(cfg.run.comm_setup_timeout_s, "start-up", "run.comm_setup_timeout_s", "every rank was built")
        channels = open_comms(setup) if busy else None
        startup.started(world, live, "comm", time.monotonic() - t1 if busy else 0.0, cfg.run.comm_setup_timeout_s,
                        t1, log, who, lambda: _PREEMPTED)
    except (startup.StartupTimeout, CollectiveTimeout) as e:
        return sys.exit(startup.timed_out(world, e, log))
    return channels


def _doorbell(cfg: Config, world):
    """Every rank (collective): the orchestrator's star of wake-up sockets, or None (polling)."""
    if cfg.run.idle_wait != "doorbell":
        return None
    from flexmarl_hpc.runtime.doorbell import connect
    bell = connect(world, 0)
    if bell is None and world.Get_rank() == 0:
        print("run.idle_wait=doorbell: the wake-up sockets could not be opened; waiting ranks "
              "poll (run.idle_wait=poll)", file=sys.stderr, flush=True)
    return bell


def _liveness(world):
    """Every rank (collective): the liveness star (runtime/liveness.py), watched from now
    on. A worker exits 75 when the orchestrator ends; the orchestrator's transport reports
    a worker that ends. None (a line on rank 0) when its sockets cannot be opened."""
    from flexmarl_hpc.runtime.liveness import connect, exit_on_lost
    live = connect(world, 0)
    rank = world.Get_rank()
    if live is None:
        if rank == 0:
            print("liveness sockets could not be opened: a rank that dies is found only after "
                  "run.worker_timeout", file=sys.stderr, flush=True)
        return None
    live.watch(None if rank == 0 else exit_on_lost(rank))
    return live


def _exit_untaken(log, layout: RankLayout, rank: int) -> None:
    """The liveness thread of rank 0: a worker has ended and the main thread has not taken
    it in TAKE_GRACE_S, so it is stuck (inside MPI: runtime/liveness.py). Say so and end
    rank 0 as a kill would (its liveness sockets close: every worker exits 75 within a
    second); no checkpoint, the store's writes are journaled, the run resumes."""
    from flexmarl_hpc.orchestrator.failures import who
    from flexmarl_hpc.runtime.liveness import TAKE_GRACE_S
    log(f"{who(layout, rank)} (rank {rank}): its process has ended (liveness socket closed), and "
        f"the orchestrator has not acted on it in {TAKE_GRACE_S:g} s (stuck inside MPI: a send to "
        f"the dead rank can retry its connection forever); exiting {EXIT_REQUEUE} to requeue "
        "without a checkpoint (the run resumes from the last checkpoints and the store)")
    sys.stderr.flush()
    requeue.mark(f"{who(layout, rank)} (rank {rank}) was lost")
    os._exit(EXIT_REQUEUE)


def _orchestrate(plan: Plan, world, task, bell=None, live=None, t0: float = 0.0) -> int:
    import yaml
    cfg, layout = plan.cfg, plan.layout
    from flexmarl_hpc.orchestrator.loop import Orchestrator
    from flexmarl_hpc.store.tables import StoreFile
    from flexmarl_hpc.runtime.transport import MpiTransport
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    log_file = open(out / "train.log", "a")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    store = StoreFile(out / f"{cfg.run.name}.h5", cfg.agent_names,
                      {"config_yaml": yaml.safe_dump(to_dict(cfg), sort_keys=False),
                       "mode": cfg.run.mode, "world_size": layout.world_size},
                      chunk=cfg.store.chunk_rows, undoable=bool(cfg.workflow.episode))
    log(f"{cfg.run.name}: mode {cfg.run.mode}, agents {cfg.agent_names}, {layout.world_size} ranks "
        f"({layout.replicas} replicas, {layout.groups} trainer groups x "
        f"{layout.ranks_per_group or '+'.join(map(str, layout.group_sizes))}"
        f"{f', {layout.tool_ranks} tool ranks' if layout.tool_ranks else ''}); "
        f"store {store.path}")
    transport = MpiTransport(world, bell, live)
    if live is not None:
        live.on_untaken = lambda rank: _exit_untaken(log, layout, rank)
    tools = None
    if layout.tool_ranks:
        from flexmarl_hpc.ranks.tool_ranks import RemotePool
        tools = RemotePool(world, layout.tool_rank_list, cfg.tools, live=live)
    try:
        orch = Orchestrator(plan, task, transport, store, lambda: _PREEMPTED, log, tools)
        from flexmarl_hpc.orchestrator.failures import who
        _started(cfg, world, live, t0 or time.monotonic(), None, log, lambda r: who(layout, r))
        code = orch.run()
        transport.close()
    finally:
        store.close()
        log_file.close()
    return code
