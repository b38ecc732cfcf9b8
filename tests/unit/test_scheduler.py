"""Pure scheduler policy on skewed request patterns (no MPI, no clock)."""
from flexmarl_hpc.orchestrator.scheduler import Binder, Gate, allocate, assign, disparity, one_at_a_time, route, timeshare


def test_allocate_is_proportional_and_keeps_every_busy_agent_served():
    assert allocate({"a": 900.0, "b": 100.0}, 10) == {"a": 8, "b": 2}
    assert allocate({"a": 1000.0, "b": 1.0, "c": 0.0}, 4) == {"a": 3, "b": 1, "c": 0}
    # fewer replicas than busy agents: the biggest backlogs first
    assert allocate({"a": 5.0, "b": 50.0, "c": 20.0}, 2) == {"a": 0, "b": 1, "c": 1}
    # no work anywhere: even split
    assert allocate({"a": 0.0, "b": 0.0}, 3) == {"a": 2, "b": 1}
    for n in range(1, 9):
        assert sum(allocate({"a": 7.0, "b": 3.0, "c": 1.0}, n).values()) == n


def test_assign_moves_as_few_replicas_as_possible():
    cur = ["a", "a", "b", "b"]
    assert assign({"a": 3, "b": 1}, cur) == ["a", "a", "b", "a"]
    assert assign({"a": 2, "b": 2}, cur) == cur


def test_route_sends_each_request_to_least_outstanding_replica():
    # replica 1 is already loaded; a skewed stream of one long and many short requests
    plan = route([100, 10, 10, 10, 10, 10], {1: 50.0, 2: 0.0, 3: 0.0})
    assert plan[2] == [0]                         # the long one to an empty replica
    assert plan[3] == [1, 2, 3, 4, 5]             # short ones fill the other empty replica...
    plan = route([10] * 9, {1: 0.0, 2: 0.0, 3: 0.0})
    assert sorted(len(v) for v in plan.values()) == [3, 3, 3]     # one prompt's samples spread out
    loads = {r: sum([100, 10, 10, 10, 10, 10][i] for i in ix) for r, ix in
             route([100, 10, 10, 10, 10, 10], {1: 0.0, 2: 0.0}).items()}
    assert abs(loads[1] - loads[2]) <= 100


def test_rebind_follows_backlog_with_hysteresis():
    s = Binder(["a", "b"], 4, "flex", threshold=0.3, cooldown=3)
    b = s.initial_binding()
    assert sorted(b) == ["a", "a", "b", "b"]
    assert s.rebind({"a": 10.0, "b": 10.0}, b) is None            # balanced: keep
    new = s.rebind({"a": 1000.0, "b": 10.0}, b)                    # skewed: move replicas to a
    assert new is not None and new.count("a") == 3 and new.count("b") == 1
    # cooldown: an opposite skew right after is not acted on...
    assert s.rebind({"a": 10.0, "b": 1000.0}, new) is None
    assert s.rebind({"a": 10.0, "b": 1000.0}, new) is None
    # ...until the cooldown has passed
    later = s.rebind({"a": 10.0, "b": 1000.0}, new)
    assert later is not None and later.count("b") == 3
    # small disparities never cause churn
    assert disparity({"a": 55.0, "b": 45.0}, ["a", "b"]) < 0.3
    assert s.rebind({"a": 55.0, "b": 45.0}, ["a", "b", "a", "b"]) is None


def test_starving_agent_is_rebound_even_in_cooldown_and_with_one_replica():
    s = Binder(["a", "b"], 1, "flex", threshold=0.9, cooldown=100)
    b = s.initial_binding()
    assert b == ["a"]
    assert s.rebind({"a": 0.0, "b": 5.0}, b) == ["b"]
    assert s.rebind({"a": 5.0, "b": 0.0}, ["b"]) == ["a"]


def test_sync_mode_keeps_the_static_split():
    s = Binder(["a", "b"], 4, "sync")
    b = s.initial_binding()
    assert s.rebind({"a": 1000.0, "b": 1.0}, b) is None


def test_gating_rules():
    flex0 = Gate("flex", max_staleness=0)
    assert flex0.may_admit(3, {"a": 3, "b": 3}, synced=False)
    assert flex0.may_admit(4, {"a": 3, "b": 4}, synced=True)        # b samples step 4 while a trains
    assert not flex0.may_admit(4, {"a": 3, "b": 3}, synced=True)    # nobody can sample it yet
    assert not flex0.may_admit(5, {"a": 3, "b": 5}, synced=True)    # one step ahead of a at most
    assert flex0.may_generate(3, 3, prev_turn_left=7)               # no per-turn barrier in flex
    assert not flex0.may_generate(4, 3, 0)
    flex1 = Gate("flex", max_staleness=1)
    assert flex1.may_admit(4, {"a": 3, "b": 3}, synced=False)
    assert flex1.may_generate(4, 3, 0) and not flex1.may_generate(5, 3, 0)
    sync = Gate("sync")
    assert not sync.may_admit(3, {"a": 3, "b": 3}, synced=False)
    assert not sync.may_generate(3, 3, prev_turn_left=1)            # the per-turn barrier
    # micro-batches: flex hands out full ones at once and the tail at the end of the batch
    assert flex0.micro_batch(ready=20, remaining=32, micro=16, step_complete_everywhere=False) == 16
    assert flex0.micro_batch(ready=5, remaining=32, micro=16, step_complete_everywhere=False) == 0
    assert flex0.micro_batch(ready=5, remaining=5, micro=16, step_complete_everywhere=False) == 5
    assert sync.micro_batch(ready=20, remaining=32, micro=16, step_complete_everywhere=False) == 0
    assert sync.micro_batch(ready=32, remaining=32, micro=16, step_complete_everywhere=True) == 16


# ---------------------------------------------------------------------------------------
# level 1 over rollout pools (flexmarl_hpc/orchestrator/pool_binding.py)
# ---------------------------------------------------------------------------------------
def test_pools_rebind_only_their_replicas_to_their_agents():
    """Pool 0 (replicas 0, 1) serves the big agent only; pool 1 (replicas 2-4) serves two
    small agents. A huge backlog of `big` never takes a replica of pool 1, and the small
    agents' backlog moves replicas inside pool 1 only."""
    from flexmarl_hpc.orchestrator.pool_binding import PoolBinding
    from flexmarl_hpc.orchestrator.scheduler import Binder
    mk = lambda agents, n: Binder(agents, n, "flex", threshold=0.2, cooldown=0)
    pb = PoolBinding([([0, 1], ["big"], mk(["big"], 2)), ([2, 3, 4], ["s1", "s2"], mk(["s1", "s2"], 3))])
    b = pb.initial_binding()
    assert b[:2] == ["big", "big"] and sorted(b[2:]) == ["s1", "s1", "s2"]
    new = pb.rebind({"big": 1000.0, "s1": 0.0, "s2": 50.0}, b)
    assert new is not None and new[:2] == ["big", "big"]
    assert set(new[2:]) == {"s2"} or new[2:].count("s2") >= 2
    for backlog in ({"big": 0.0, "s1": 10.0, "s2": 0.0}, {"big": 5.0, "s1": 1.0, "s2": 1.0}):
        new = pb.rebind(backlog, new) or new
        assert new[:2] == ["big", "big"] and set(new[2:]) <= {"s1", "s2"}


def test_replica_widths_per_pool_give_each_replica_its_own_block():
    from flexmarl_hpc.runtime.devices import choose_device, replica_widths, role_widths
    from flexmarl_hpc.config.layout import RankLayout
    lay = RankLayout.of([1, 2], [2])            # rank 1: 4-GPU replica, ranks 2, 3: 1 GPU each
    rw = replica_widths(lay, (4, 1))
    assert rw == {1: 4, 2: 1, 3: 1}
    peers = [(r, lay.role_of(r)[0]) for r in range(lay.world_size)]
    gpus = [str(i) for i in range(8)]
    blocks = [choose_device(r, peers, role_widths(lay, 4), gpus, rw).gpus for r in range(lay.world_size)]
    assert blocks == [(), ("0", "1", "2", "3"), ("4",), ("5",), ("6",), ("7",)]


ALL3 = [{"p", "c", "w"}] * 2


def test_timeshare_gives_a_dominant_backlog_both_replicas_not_one():
    # 3 agents, 2 replicas: the writer's backlog dominates; the planner replica frees up
    backlog = {"p": 0.0, "c": 100.0, "w": 4000.0}
    assert timeshare(backlog, ["p", "w"], [True, False], ALL3) == ["w", "w"]
    # level-1 allocation alone pins them 1:1 while the coder has any work
    assert sorted(allocate(backlog, 2).items()) == [("c", 1), ("p", 0), ("w", 1)]
    # busy replicas keep their agent; both idle: D'Hondt, 4000/1 then 4000/2 > 100
    assert timeshare(backlog, ["c", "c"], [True, True], ALL3) == ["w", "w"]


def test_timeshare_serves_every_agent_as_the_big_backlog_drains():
    # the writer's bid halves with each replica it holds: the coder wins once 2 x its
    # backlog exceeds the writer's, and never waits while a replica idles for nothing
    assert timeshare({"c": 100.0, "w": 150.0}, ["w", "w"], [True, False], [{"c", "w"}] * 2) == ["c", "w"]
    assert timeshare({"c": 100.0, "w": 250.0}, ["w", "w"], [True, False], [{"c", "w"}] * 2) == ["w", "w"]
    # simulated: replicas alternate finishing batches of 16 requests; every agent's
    # backlog is served in proportion, none starves
    backlog = {"c": 16.0 * 16, "w": 64.0 * 64}
    binding, served = ["c", "w"], {"c": 0, "w": 0}
    for k in range(40):
        r = k % 2
        idle = [i == r for i in range(2)]
        binding = timeshare(backlog, binding, idle, [{"c", "w"}] * 2)
        a = binding[r]
        if backlog[a] > 0:
            per = 16.0 if a == "c" else 64.0
            backlog[a] = max(0.0, backlog[a] - 16 * per)
            served[a] += 1
    assert backlog == {"c": 0.0, "w": 0.0} and served == {"c": 1, "w": 4}


def test_timeshare_keeps_a_replica_off_agents_it_cannot_serve_now_and_ties_keep_it():
    # the writer is mid-step (training): a replica lacking its weights cannot take it
    assert timeshare({"c": 10.0, "w": 4000.0}, ["c", "w"], [True, False], [{"c"}, {"c", "w"}]) == ["c", "w"]
    # nothing it can serve has backlog: it stays where it is
    assert timeshare({"c": 0.0, "w": 4000.0}, ["c", "w"], [True, False], [{"c"}, {"c", "w"}]) == ["c", "w"]
    # equal bids: no move (a move may cost a weight sync)
    assert timeshare({"c": 100.0, "w": 100.0}, ["c", "w"], [True, True], [{"c", "w"}] * 2) == ["c", "w"]


def test_rebind_time_shares_in_flex_only_and_not_without_load_balancing():
    backlog = {"p": 0.0, "c": 100.0, "w": 4000.0}
    flex = Binder(["p", "c", "w"], 2, "flex")
    assert flex.rebind(backlog, ["c", "w"], [True, False], ALL3) == ["w", "w"]
    assert flex.rebind(backlog, ["c", "w"], [True, False], ALL3) == ["w", "w"]     # no cooldown
    assert flex.rebind(backlog, ["c", "w"], [True, False], ALL3) == ["w", "w"]
    for s in (Binder(["p", "c", "w"], 2, "sync"), Binder(["p", "c", "w"], 2, "flex", load_balance=False)):
        assert s.rebind(backlog, ["c", "w"], [True, False], ALL3) is None


def test_only_flex_with_load_balancing_reads_servable_so_the_orchestrator_may_skip_it():
    """The orchestrator builds `servable` (a set per replica per round, 8% of `simulate
    paper`) only when `wants_servable`: every other scheduler must answer the same without it,
    however restrictive the sets it would have had."""
    backlog, idle = {"p": 0.0, "c": 100.0, "w": 4000.0}, [True, True]
    for binding in (["c", "w"], ["p", "p"], ["w", "w"]):
        for make in (lambda: Binder(["p", "c", "w"], 2, "sync"),
                     lambda: Binder(["p", "c", "w"], 2, "flex", load_balance=False),
                     lambda: Binder(["p", "c", "w"], 2, "sync", one_agent=True),
                     lambda: Binder(["p", "c", "w"], 2, "flex", one_agent=True)):
            assert not make().wants_servable
            for servable in (ALL3, [set(), set()], [{"p"}, {"c"}]):
                assert make().rebind(backlog, binding, idle, None) == make().rebind(backlog, binding, idle, servable)
    flex = Binder(["p", "c", "w"], 2, "flex")
    assert flex.wants_servable
    assert flex.rebind(backlog, ["c", "w"], idle, [set(), set()]) != flex.rebind(backlog, ["c", "w"], idle, ALL3)


def test_rebind_keeps_one_replica_per_agent_when_there_are_enough_replicas():
    """2 agents on 2 replicas: a dominant backlog does not take the other agent's only
    replica at every batch boundary (that re-syncs both agents to both replicas each
    version); the threshold/cooldown allocation applies instead."""
    s = Binder(["a", "b"], 2, "flex", threshold=0.9, cooldown=100)
    assert s.rebind({"a": 4000.0, "b": 100.0}, ["a", "b"], [True, True], [{"a", "b"}] * 2) is None


def test_one_agent_at_a_time_switches_every_replica_only_when_the_agent_is_done():
    """MAS-RL's time-sharing: all replicas serve one agent; they move (to the agent with the
    most backlog) only once that agent has nothing pending and every replica is idle."""
    idle, busy = [True] * 3, [True, False, True]
    assert one_at_a_time({"a": 5.0, "b": 9.0}, ["a", "b", "a"], idle) == ["b"] * 3     # start: one agent
    assert one_at_a_time({"a": 5.0, "b": 9.0}, ["a"] * 3, idle) is None                # a still has work
    assert one_at_a_time({"a": 0.0, "b": 9.0}, ["a"] * 3, busy) is None                # a's request in flight
    assert one_at_a_time({"a": 0.0, "b": 9.0}, ["a"] * 3, idle) == ["b"] * 3
    assert one_at_a_time({"a": 0.0, "b": 0.0}, ["a"] * 3, idle) is None                # nothing to serve
    s = Binder(["a", "b"], 3, "sync", one_agent=True)
    assert s.rebind({"a": 0.0, "b": 2.0}, ["a"] * 3, idle, [set()] * 3) == ["b"] * 3
    assert Binder(["a", "b"], 3, "sync").rebind({"a": 0.0, "b": 2.0}, ["a"] * 3, idle, [set()] * 3) != ["b"] * 3


# ---------------------------------------------------------------------------------------
# level 1 with shared trainer groups: replicas move only onto agents servable now
# ---------------------------------------------------------------------------------------
def test_rebind_moves_no_replica_onto_an_agent_it_cannot_serve_now():
    """b shares a trainer group with a resident agent that is training: no replica holds b's
    weights and none can be synced now, so a replica moved to b would idle (issue 37: flex
    212 s a step against no-LB's 110 s at 4 agents a group). Its big backlog moves nothing."""
    s = Binder(["a", "b", "c"], 4, "flex", threshold=0.2, cooldown=0)
    binding = ["a", "a", "c", "c"]
    servable = [{"a", "c"}] * 4                      # b's group is busy with another agent
    new = s.rebind({"a": 10.0, "b": 1000.0, "c": 10.0}, binding, [True] * 4, servable)
    assert new is None or "b" not in new
    # once b's group is free (b syncable), b gets replicas at once (starving skips the cooldown)
    s = Binder(["a", "b", "c"], 4, "flex", threshold=0.2, cooldown=100)
    new = s.rebind({"a": 10.0, "b": 1000.0, "c": 10.0}, binding, [True] * 4, [{"a", "b", "c"}] * 4)
    assert new is not None and new.count("b") >= 1


def _shared_group_run(s: Binder, rounds: int) -> tuple[dict, int]:
    """A toy run of the pure scheduler: agents a (resident) and b (parked) share trainer group
    G, c has its own. A replica generates one unit a round for its agent if it holds that
    agent's current version; it is synced to it when the agent's group is free (a sync takes
    the group for a round); 4 units are a step: training takes the group 3 rounds (b first
    swaps in: 4) and bumps the version. Returns each agent's steps and the rounds used."""
    backlog, done, ver = {"a": 40.0, "b": 40.0, "c": 40.0}, {"a": 0, "b": 0, "c": 0}, {"a": 0, "b": 0, "c": 0}
    binding, held, busy_until = ["a", "a", "c"], [("a", 0), ("a", 0), ("c", 0)], 0
    for t in range(rounds):
        free = {"c"} | ({"a", "b"} if t >= busy_until else set())
        servable = [free | {x for x in ver if held[r] == (x, ver[x])} for r in range(3)]
        new = s.rebind(backlog, binding, [True] * 3, servable)
        if new is not None:
            assert all(x == y or y in servable[r] for r, (x, y) in enumerate(zip(binding, new)))
            binding = new
        for r, x in enumerate(binding):
            if held[r] != (x, ver[x]) and x in free:
                held[r] = (x, ver[x])
                busy_until = t + 1 if x != "c" else busy_until
            elif held[r] == (x, ver[x]) and backlog[x] > 0:
                backlog[x] -= 1
                done[x] += 1
        for x in ("a", "b", "c"):
            if done[x] >= 4 and (x == "c" or t >= busy_until):
                done[x] -= 4
                ver[x] += 1
                busy_until = t + (4 if x == "b" else 3) if x != "c" else busy_until
        if not any(backlog.values()) and not any(done.values()):
            return ver, t
    return ver, rounds


def test_a_parked_agent_with_backlog_is_not_starved():
    """Blocking every parked agent deadlocks: b never gets a replica, so never a step to train,
    so never the group. Here b is servable whenever G is free, gets a replica then, and every
    agent trains all its 10 steps."""
    ver, t = _shared_group_run(Binder(["a", "b", "c"], 3, "flex", threshold=0.2, cooldown=2), 2000)
    assert ver == {"a": 10, "b": 10, "c": 10} and t < 2000


def test_the_window_of_steps_in_flight_is_the_schedulers_admission():
    """config.resources.steps_in_flight is what may_admit admits at most beyond the slowest
    agent's step (over every spread of two agents' versions), and what preflight sizes the
    samples' memory by (the simulator's kept weights read it too: sim/inprocess.py)."""
    from itertools import product
    from types import SimpleNamespace

    from flexmarl_hpc.config.load import load_config, to_dict
    from flexmarl_hpc.config.resources import steps_in_flight
    from flexmarl_hpc.config.plan import resolve
    from flexmarl_hpc.launch.preflight import estimate_memory
    from tests.conftest import ROOT
    for s in range(4):
        sched = Gate("flex", max_staleness=s)
        widest = 0
        for va, vb in product(range(10), repeat=2):
            low = min(va, vb)
            admitted = [t for t in range(low, 30) if sched.may_admit(t, {"a": va, "b": vb}, synced=True)]
            assert admitted == list(range(low, low + len(admitted))), (s, va, vb)
            widest = max(widest, len(admitted))
        assert widest == steps_in_flight(s)
    cfg = {s: load_config(ROOT / "configs/local.yaml", [f"pipeline.max_staleness={s}"]) for s in (0, 2)}
    models = {a: SimpleNamespace(**to_dict(cfg[0].model_for(a)), vocab_size=64) for a in cfg[0].agent_names}
    samples = {s: estimate_memory(resolve(c), models).samples for s, c in cfg.items()}
    assert samples[2] * steps_in_flight(0) == samples[0] * steps_in_flight(2)
