"""Location-agnostic state transfer: device <-> host on one rank (rank -> rank over real MPI:
tests/mpi/test_state_swap_mpi.py)."""
import torch
from mpi4py import MPI

from flexmarl_hpc.runtime.state_swap import HostBuffers, Location, StateMover, Swappable
from flexmarl_hpc.trainer.torch_trainer import TorchTrainer
from tests.helpers import make, step


def test_swap_out_and_in_is_bit_identical_and_continues_the_same():
    mover = StateMover(MPI.COMM_WORLD, MPI.COMM_SELF, 0, lambda g: [0], {}, no_build)
    mover.trainers["a"] = make()
    twin = make()
    for s in range(2):
        step(mover.trainers["a"], s)
        step(twin, s)
    before = {k: v.clone() for k, v in mover.trainers["a"].state().items()}
    mover.move("a", Location(0, True), Location(0, False))        # park in host memory
    assert "a" not in mover.trainers and "a" in mover.parked
    mover.move("a", Location(0, False), Location(0, True))        # and back on the device
    after = mover.trainers["a"].state()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    step(mover.trainers["a"], 5)
    step(twin, 5)
    for (k, x), y in zip(twin.state().items(), mover.trainers["a"].state().values()):
        assert torch.equal(x, y), k


def no_build(agent):
    raise AssertionError(f"swap-in rebuilt trainer {agent}")


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_swap_in_keeps_module_and_optimizer_and_reads_no_checkpoint(monkeypatch):
    """Offload/onload: the same module, parameters and optimizer come back, nothing is built
    or loaded; the host buffers are allocated once and reused by later swaps; while parked
    the parameters live in those buffers (the device copy is gone) and state() reads them."""
    def spy(*a, **k):
        raise AssertionError("swap-in read a state/checkpoint")
    import flexmarl_hpc.store.checkpoint as ckpt
    monkeypatch.setattr(ckpt, "load_latest", spy)
    mover = StateMover(MPI.COMM_WORLD, MPI.COMM_SELF, 0, lambda g: [0], {}, no_build)
    tr = mover.trainers["a"] = make()
    step(tr, 0)
    monkeypatch.setattr(TorchTrainer, "load_state", spy)
    assert isinstance(tr, Swappable)
    model, opt, params = tr.model, tr.opt, list(tr.model.parameters())
    ptrs = None
    for round_ in range(3):
        before = {k: v.clone() for k, v in tr.state().items()}
        live_ptr = tr.flat.data_ptr()
        mover.move("a", Location(0, True), Location(0, False))
        host: HostBuffers = mover.parked.hosts["a"]
        hflat = host.buffers["params"]
        assert tr.flat is hflat and all(
            hflat.data_ptr() <= p.data_ptr() < hflat.data_ptr() + hflat.numel() for p in params)
        assert live_ptr != hflat.data_ptr()          # the device copy was dropped, not aliased
        same(before, mover.parked["a"])               # checkpoints/syncs read the parked copy
        now = {k: b.data_ptr() for k, b in host.buffers.items()}
        assert ptrs is None or now == ptrs, "host buffers reallocated"
        ptrs = now
        # the flat parameters + per parameter Adam's step, exp_avg, exp_avg_sq (grads are None)
        assert host.allocations == len(host.buffers) == 1 + 3 * len(tr.params)
        mover.move("a", Location(0, False), Location(0, True))
        assert mover.trainers["a"] is tr and tr.model is model and tr.opt is opt
        assert list(tr.model.parameters()) == params and all(q is p for q, p in zip(opt.param_groups[0]["params"], params))
        assert tr.flat.data_ptr() != hflat.data_ptr()
        same(before, tr.state())
        step(tr, 10 + round_)


def test_resume_into_a_parked_agent_and_trainers_without_the_interface():
    """A state loaded into a parked (offloaded) agent comes back with it; a trainer without
    offload/onload is parked as a host copy and rebuilt on swap-in (the fallback path)."""
    mover = StateMover(MPI.COMM_WORLD, MPI.COMM_SELF, 0, lambda g: [0], {}, no_build)
    mover.trainers["a"] = make()
    other = make(seed=7)
    step(other, 1)
    mover.move("a", Location(0, True), Location(0, False))
    mover.parked["a"] = {k: v.clone() for k, v in other.state().items()}      # restore_trainers
    mover.move("a", Location(0, False), Location(0, True))
    same(other.state(), mover.trainers["a"].state())

    class Plain:                                   # state()/load_state() only
        def __init__(self, inner):
            self.inner = inner
        def state(self):
            return self.inner.state()
        def load_state(self, st):
            self.inner.load_state(st)
    built = []
    mover = StateMover(MPI.COMM_WORLD, MPI.COMM_SELF, 0, lambda g: [0], {},
                       lambda a: built.append(a) or Plain(make(seed=3)))
    mover.trainers["b"] = Plain(other)
    mover.move("b", Location(0, True), Location(0, False))
    assert "b" in mover.parked.states and not isinstance(mover.parked.states["b"], Swappable)
    mover.move("b", Location(0, False), Location(0, True))
    assert built == ["b"]
    same(other.state(), mover.trainers["b"].state())


def test_a_shard_header_is_taken_only_by_the_same_layout_and_storages():
    """The destination's answer to a shard move (runtime/state_swap.answer_for): the same key
    and storages take the bytes, another key falls back to state(), the same key with other
    storages is refused in one line naming the agent and the first difference."""
    from flexmarl_hpc.runtime.state_swap import FALLBACK, MoveHeader, answer_for
    sizes = [("storage.0", 64), ("storage.1", 32)]
    head = MoveHeader("solver", ("megatron", 2, 1), tuple(sizes), 3, b"")
    assert head.nbytes == 96
    assert answer_for(head, ("megatron", 2, 1), sizes) == ""
    assert answer_for(head, ("megatron", 1, 2), sizes) == FALLBACK
    assert answer_for(head, None, None) == FALLBACK                     # no ShardMovable here
    err = answer_for(head, ("megatron", 2, 1), [("storage.0", 64), ("storage.1", 16)])
    assert "agent 'solver'" in err and "('storage.1', 32) != ('storage.1', 16)" in err
    assert "2 storages != 3" in answer_for(head, ("megatron", 2, 1), [*sizes, ("storage.2", 4)])


def test_another_layout_of_the_same_model_is_resharded():
    """Another key but the same reshard_key (model, precision, spec): the plan's pieces, not
    state(); another model, or a source that cannot reshard: the fallback."""
    from flexmarl_hpc.runtime.state_swap import FALLBACK, RESHARD, MoveHeader, answer_for
    head = MoveHeader("solver", ("megatron", 2, 1), (("storage.0", 64),), 3, b"", compat=("megatron", "m"))
    assert answer_for(head, ("megatron", 1, 2), None, ("megatron", "m")) == RESHARD
    assert answer_for(head, ("megatron", 1, 2), None, ("megatron", "other")) == FALLBACK
    assert answer_for(head, None, None, None) == FALLBACK
    old = MoveHeader("solver", ("megatron", 2, 1), (("storage.0", 64),), 3, b"")     # no compat sent
    assert answer_for(old, ("megatron", 1, 2), None, ("megatron", "m")) == FALLBACK
