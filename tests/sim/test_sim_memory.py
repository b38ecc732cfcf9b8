"""simulate memory (flexmarl_hpc/sim/memory.py): the production trainer code on fake tensors
at real shapes, cross-checked against the analytic count, and the refusals the issue asks for
(a 32B agent on a TP 1 replica, a 32B trainer at TP 1 PP 1), each naming the rank."""
from __future__ import annotations

import dataclasses
import json

from flexmarl_hpc.config.plan import resolve
from tests.conftest import ROOT

PAPER = str(ROOT / "configs" / "paper_3x32b_7x14b.yaml")
GB = 1e9
# a mid-size shape: large enough that states and activations dominate, small enough for seconds
MID = ["model.hidden_size=1024", "model.num_layers=4", "model.num_heads=16", "model.num_kv_heads=4",
       "model.intermediate_size=2816", "model.max_seq_len=1024", "trainer.micro_batch_size=8",
       "trainer.backend=megatron", "trainer.ranks_per_group=4", "trainer.tensor_parallel=2",
       "trainer.precision=bf16", "trainer.recompute=full"]


def _paper(**group0):
    """The paper config, its first group (shop32_0) changed as given."""
    from flexmarl_hpc.config.load import load_config
    cfg = load_config(PAPER)
    groups = list(cfg.trainer.named_groups)
    groups[0] = dataclasses.replace(groups[0], **group0)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, named_groups=groups))


def test_fake_run_agrees_with_the_analytic_count_at_a_mid_size_shape():
    """States within 2%, activations (full recompute) within 10%: the fake run counts what
    the formula counts, on the production code path (a mutation that drops the grad buffer,
    the optimizer's states or the kept layer inputs moves it out of both bands)."""
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.config.resources import param_count
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.sim.memory import analytic_device, run_jobs
    cfg = load_config(ROOT / "configs" / "local.yaml", MID)
    task = build_task(cfg)
    build, train, opt, save, send = run_jobs([(resolve(cfg), 0, 0, None, 0, 1024)], 1)[0]   # its own process, as the CLI; 1024 tokens
    P = param_count(cfg.model, len(task.vocab))
    rows = cfg.trainer.micro_batch_size // 2            # DP 2
    a = analytic_device(P // 2, 2, True, rows, 1024, 1024, 16, 4, "full", 2)
    states = a["states"] + a["buffer"]
    print(f"states fake {opt.device_live / GB:.3f} GB, analytic {states / GB:.3f} GB; activations fake "
          f"{(train.device - build.device_live) / GB:.3f} GB, analytic {(a['activations'] + a['buffer']) / GB:.3f} GB")
    assert abs(opt.device_live - states) <= 0.02 * states
    assert abs((train.device - build.device_live) - (a["activations"] + a["buffer"])) <= 0.10 * a["activations"]
    assert [p.name for p in (build, train, opt, save, send)] == ["build", "train step", "optimizer step",
                                                                "checkpoint save", "weight sync (send)"]
    # the save (megatron's fully_reshardable gather over gloo to DP rank 0, which rank 0 is;
    # one DDP bucket of the rank's whole buffer without overlap_grad_reduce): nothing on the
    # device; on the host 12 B of world states + the bf16 weights + 8 B + 12 B / 2 of
    # per-bucket copies a param
    mine = P // 2
    assert save.device == opt.device_live
    assert 28 * mine <= save.host <= 28.3 * mine + opt.host, (save.host, opt.host, mine)


class _Stage:
    """A trainer stage's sync side (sync_layouts, sync_stream) whose stream yields each tensor
    as a TP gather does: made on the device when drawn, gone after it is copied."""
    pp_rank = 0
    shapes = {"embed": (3 * 1024, 256), "norm": (256,), "mlp": (512, 256)}      # fp32: 3 MiB, 1 KiB, 512 KiB

    def sync_layouts(self):
        import torch
        return [[(k, s, torch.float32) for k, s in self.shapes.items()]]

    def sync_stream(self, pieces=None, dest=None):     # whole tensors (fill_bucket cuts them)
        import torch
        from flexmarl_hpc.sim.fake_memory import device_scope
        for k, s in self.shapes.items():
            with device_scope():
                t = torch.empty(s)
            yield k, t
            del t


def test_the_sync_sender_holds_two_buckets_however_large_a_tensor():
    """The send phase (sim/memory._send: the production weight_sync.fill_bucket on fake
    tensors) with 1 MiB buckets and a 3 MiB tensor: two bucket buffers + the streamed tensor
    (5 MiB), not two buffers of that tensor + it (9 MiB, before tensors went in pieces)."""
    from flexmarl_hpc.sim.memory import _send
    from flexmarl_hpc.sim.fake_memory import track
    MiB = 2**20
    with track() as c:
        _send(_Stage(), 1.0, None)
    assert 3 * MiB < c.peak["device"] <= 2 * MiB + 3 * MiB, c.peak


def test_every_pipeline_stages_sender_runs_its_send_within_the_bucket_bound():
    """PP 2: the check runs the last stage's sender (the LM head's) as well as the leader, each
    through the production sync_stream on fake tensors; a rank that sends nothing stops after
    the optimizer step. With 1 MiB buckets the 5.8 MB bf16 gate/up/down tensors go in pieces, so a
    sender's extra device bytes are its 2 bucket buffers and nothing else (each range assembled
    in place in a bucket, an o_proj/down_proj column block received through the other buffer:
    weight_sync.Destination), where a range-sized tensor beside them read 3.5 MiB (before
    2026-11-26) and a whole-tensor gather holds 5.8 MB more."""
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.sim.memory import checked_ranks, run_jobs, sender_ranks
    cfg = load_config(ROOT / "configs" / "local.yaml", MID + ["trainer.pipeline_parallel=2", "weight_sync.bucket_mb=1"])
    grp = resolve(cfg).groups[0]
    assert sender_ranks(grp) == [0, 2] and checked_ranks(grp) == [0, 2, 3]
    first, last, idle = run_jobs([(resolve(cfg), 0, r, None, 0) for r in (0, 2, 3)], 2)
    assert [p.name for p in idle] == ["build", "train step", "optimizer step", "checkpoint save"]
    for phases in (first, last):
        opt, send = phases[2], phases[4]
        assert send.name == "weight sync (send)"
        extra = send.device - opt.device_live
        print(f"send extra {extra / 2**20:.2f} MiB")
        assert 2**20 < extra <= 2 * 2**20, extra


def test_refuses_a_32b_trainer_at_tp1_pp1_naming_the_rank():
    from flexmarl_hpc.sim.memory import check_config, failures
    rows = check_config(resolve(_paper(tensor_parallel=1, pipeline_parallel=1)), 64.0, workers=2, only=("shop32_0",))
    bad = failures(rows)
    assert bad and bad[0].startswith("group shop32_0 rank 353 (leader, first stage): build needs")
    over = [r for r in rows if r.rank.startswith("rank 353") and r.phase == "build"][0]
    assert over.device_bytes > 32e9 * 6                  # bf16 weights + fp32 grads of all 32B params
    assert {r.phase for r in rows if r.rank.startswith("rank 353")} == {"build", "node total"}   # stops there
    # TP 1 x PP 1 x DP 32: the default, data-parallel and (shop32_0, p32) sync communicators
    assert (over.comms, over.context > 0, over.fragmentation) == (3, True, int(0.1 * over.tensor_bytes))
    assert "; remedy: raise group shop32_0's tensor_parallel or pipeline_parallel (TP 1 x PP 1" in bad[0]


def test_tp8_pp2_build_fits_where_tp1_does_not():
    """The control of the refusal above: the paper's own TP 8 x PP 2 shard builds in 64 GB.
    Its ~2 B params hold at least bf16 weights + fp32 grads (6 B/param, 12 GB); the whole
    32B model in fp32 (128.7 GB, what the tracker read while it counted meta tensors) fails."""
    from flexmarl_hpc.sim.memory import run_jobs
    cfg = _paper()
    build = run_jobs([(resolve(cfg), 0, 31, None, 1)], 1)[0][0]
    assert build.name == "build" and 12e9 < build.device < 64e9


def _tp1_p32(tmp_path) -> str:
    """A copy of the paper config with pool p32's replicas at TP 1 (overrides cannot index
    the pools list)."""
    text = open(PAPER).read().replace("gpus_per_replica: 4", "gpus_per_replica: 1")
    assert "gpus_per_replica: 1, gpu_memory_gb: 64, agents: [shop32_0" in text
    path = tmp_path / "paper_tp1.yaml"
    path.write_text(text)
    return str(path)


def test_refuses_a_32b_agent_on_a_tp1_replica_naming_the_rank():
    """Engine start = max(the pool's vLLM fraction x GPU, what vLLM needs to start: (weights /
    TP + one sequence's KV) / fraction); a weight receive adds one bucket beside it."""
    import torch
    from flexmarl_hpc.rollout.vllm_engine import memory_fraction
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.sim.memory import failures, replica_rows
    cfg = _paper()
    pools = list(cfg.rollout.pools)
    task = build_task(cfg)
    tp1 = dataclasses.replace(cfg, rollout=dataclasses.replace(
        cfg.rollout, pools=[dataclasses.replace(pools[0], gpus_per_replica=1)] + pools[1:]))
    plan = resolve(cfg)         # the pool as validation would refuse it: the plan edited past it
    plan = dataclasses.replace(plan, cfg=tp1, pools=(dataclasses.replace(plan.pools[0], gpus_per_replica=1),
                                                     *plan.pools[1:]))
    engine, receive = replica_rows(plan, task, 0, 1, int(64 * GB), 0, torch.bfloat16)
    bad = failures([engine, receive])
    assert bad and bad[0].startswith("pool p32 rank 1 (replica 0, GPU 0): engine start")
    from flexmarl_hpc.config.hf_config import model_args
    from flexmarl_hpc.ranks.build import receive_span
    span = receive_span(cfg, [model_args(cfg, task, "shop32_0")], torch.bfloat16)   # the receive buffer
    fraction = memory_fraction(64, span, 3)                                         # 3 groups feed p32
    assert engine.device_bytes > 32e9 * 2 / fraction                     # the bf16 weights alone
    assert "remedy: raise pool p32's gpus_per_replica (TP 1" in bad[0]
    # TP 4 (the paper's): vLLM takes its fraction, a receive adds one bucket (with the
    # allocator's rounding) and its 3 sync communicators' NCCL buffers, within 64 GB
    from flexmarl_hpc.config.gpu_memory import nccl_comm_bytes
    engine4, receive4 = replica_rows(resolve(cfg), task, 0, 1, int(64 * GB), 0, torch.bfloat16)
    assert engine4.device_bytes == int(fraction * 64 * GB)
    assert (receive4.comms, receive4.nccl, receive4.context) == (3, 3 * nccl_comm_bytes(), 0)
    assert receive4.device_bytes - engine4.device_bytes == \
        receive4.tensor_bytes - engine4.device_bytes + receive4.nccl + receive4.fragmentation
    assert receive4.tensor_bytes - engine4.device_bytes == span <= cfg.weight_sync.bucket_mb * 2**20
    assert receive4.device_bytes <= 64 * GB and not failures([engine4, receive4])
    assert engine4.host_bytes == receive4.host_bytes == 0                # no host copies


def test_cli_exit_code_and_json_name_the_rank(capsys, tmp_path):
    """Exit 1 names the rank over, with a remedy. The paper's p32 (TP 4) fits; at TP 2 on 36
    GB GPUs vLLM needs more than its fraction (which leaves the receive buffer and 3 sync
    communicators free) to hold the 32B TP shard, so the receive has no room beside it: raise
    TP. A TP 1 copy of p32 is refused before the check, by the config's own weights-fit rule,
    naming the field (exit 2)."""
    from flexmarl_hpc import simulate
    assert simulate.main(["memory", PAPER, "--only", "p32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"]
    tp2 = tmp_path / "paper_tp2.yaml"
    tp2.write_text(open(PAPER).read().replace("gpus_per_replica: 4, gpu_memory_gb: 64, agents: [shop32",
                                              "gpus_per_replica: 2, gpu_memory_gb: 36, agents: [shop32"))
    assert simulate.main(["memory", str(tp2), "--only", "p32", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["fits"] and out["failures"] == [
        "pool p32 rank 1 (replica 0, GPU 0): weight receive (one bucket) needs 38.7 GB of device memory, more than "
        "its 36 GB; remedy: raise pool p32's gpus_per_replica (TP 2: each GPU holds 1/TP of the weights and KV "
        "cache) or lower rollout.max_model_len (vLLM needs more than its memory fraction to start, so the "
        "receive has no room)"]
    assert simulate.main(["memory", _tp1_p32(tmp_path), "--only", "p32"]) == 2
    assert "rollout.pools[0].gpus_per_replica: pool too small for agent 'shop32_0'" in capsys.readouterr().err
    assert simulate.main(["memory", PAPER, "--only", "nope"]) == 2
    assert "--only: no pool or group ['nope']" in capsys.readouterr().err


def test_a_node_over_its_mem_is_named():
    """node_limit is the script's --mem (resources.component_mem: a set size, or auto: the
    node's GPUs x slurm.mem_per_gpu; mem 0, the whole node: unchecked), and a group's node
    total (its leader + the other ranks of the node, each with the parked states of the
    group's other agents) over it is named."""
    from flexmarl_hpc.sim.memory import Phase, _group_rows, failures, node_limit
    cfg = _paper()
    grp = cfg.trainer.named_groups[0]
    comps = {c.name: c for c in resolve(cfg).components}
    comp = comps["group shop32_0"]
    assert node_limit(cfg, comp) == 16 * 48 * 2**30                              # auto: 16 GPUs x 48G
    assert node_limit(cfg, dataclasses.replace(comp, slurm=dataclasses.replace(grp.slurm, mem="512G"))) == 512 * 2**30
    assert node_limit(cfg, dataclasses.replace(comp, slurm=dataclasses.replace(grp.slurm, mem="0"))) == 0
    cpu = dataclasses.replace(comp, slurm=dataclasses.replace(grp.slurm, gpus_per_node=0, cpus_per_task=2))
    assert node_limit(cfg, cpu) == 16 * 2 * 1000 * 2**20                          # auto: CPUs x mem_per_cpu
    results = {(0, 0): [Phase("build", 0, int(40 * GB), 0, int(2 * GB))],
               (0, 16): [Phase("build", 0, int(10 * GB), 0, int(2 * GB))],
               (0, 31): [Phase("build", 0, int(10 * GB), 0, int(2 * GB))]}
    group = _paper().trainer.named_groups[0]
    tight = dataclasses.replace(comp, slurm=dataclasses.replace(grp.slurm, mem="128G"))
    rows = _group_rows(resolve(cfg), group, 0, results, {**comps, "group shop32_0": tight}, int(64 * GB))
    bad = failures(rows)
    # DP 2: half a node's ranks are DP rank 0 (the save gathers on them), each like rank 0
    assert rows[-1].node_host_bytes == 8 * int(40 * GB) + 8 * int(10 * GB)
    first = comp.first_rank
    assert bad == [f"group shop32_0 rank {first} (16 ranks a node): 400.0 GB of host "
                   f"memory, more than the node's --mem 128G (137.4 GB); remedy: raise group shop32_0's "
                   f"slurm.mem or slurm.mem_per_gpu, or spread its 32 ranks over more nodes (slurm.nodes 2)"]
    assert not failures(_group_rows(resolve(cfg), group, 0, results, comps, int(64 * GB)))     # 400 GB within 768G
    # two more agents on the group: each rank keeps a pinned host copy of every agent's state
    # (2 GB each), the resident one's too (state_swap.HostBuffers are kept for reuse)
    three = dataclasses.replace(group, agents=["shop32_0", "x", "y"])
    assert _group_rows(resolve(cfg), three, 0, results, comps, int(64 * GB))[-1].node_host_bytes == int(400 * GB) + 16 * int(6 * GB)


def test_the_largest_stage_senders_send_is_reported_per_group():
    from flexmarl_hpc.sim.memory import Row, send_peaks
    rows = [Row("group a", "rank 1 (leader, first stage)", "weight sync (send)", int(27.2 * GB), 0, 0),
            Row("group a", "rank 17 (stage 1 sender)", "weight sync (send)", int(27.5 * GB), 0, 0),
            Row("group a", "rank 17 (stage 1 sender)", "train step", int(40 * GB), 0, 0),
            Row("pool p", "rank 0", "weight receive (one bucket)", int(50 * GB), 0, 0)]
    assert send_peaks(rows) == ["group a: weight sync send peak 27.5 GB, the largest of 2 stage sender(s), "
                                "rank 17 (stage 1 sender)"]


# a torch-engine replica at a small shape: the weights (two agents, 1.3 MB each in fp32)
# outweigh the receive buffer of a 0.25 MiB bucket, so dropping either is seen
SMALL_TORCH = ["model.hidden_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
               "model.intermediate_size=384", "model.max_seq_len=64", "rollout.max_batch=8",
               "weight_sync.bucket_mb=0.25"]


def _weight_bytes(args) -> int:
    """fp32 bytes of an agent's model, counted from its parameters (a tied LM head once)."""
    import torch
    from flexmarl_hpc.learn.model import CausalLM
    with torch.device("meta"):
        return 4 * sum(p.numel() for p in CausalLM(args).parameters())


def test_torch_replica_counts_the_received_weights_and_its_buffers():
    """The replica's fake run (sim/torch_replica.py) holds, after the weight receive, every
    served agent's weights (TorchEngine.load_weights builds and keeps each model) and the
    receive buffer (the plan's span), a relay a second of the largest bucket; the generate
    adds at least its KV cache. A mutation that skips the load, drops the buffer or the
    relay's second, or the KV cache misses these counts."""
    import torch
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.config.hf_config import model_args
    from flexmarl_hpc.learn.model import hf_shapes
    from flexmarl_hpc.runtime import weight_sync
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.sim.torch_replica import generate_shape, torch_replica
    cfg = load_config(ROOT / "configs" / "local.yaml", SMALL_TORCH)
    task = build_task(cfg)
    agents = cfg.agent_names
    args = model_args(cfg, task, agents[0])
    layout = [(k, s, torch.float32) for k, s in hf_shapes(args).items()]
    plan = weight_sync.SyncPlan((0,), (weight_sync.plan_buckets(layout, int(0.25 * 2**20)),))
    weights = sum(_weight_bytes(model_args(cfg, task, a)) for a in agents)
    assert weights > 8 * plan.span                     # the check sees the weights, not just the buffer
    last = torch_replica(resolve(cfg), task, 0, None, relay=False)
    relay = torch_replica(resolve(cfg), task, 0, None, relay=True)
    assert [p.name for p in last] == ["engine start", "weight receive", "generate"]
    assert last[0].host < 0.01 * weights               # the engine builds its models at the first load
    rope = last[1].live - weights - plan.span          # the models' rotary tables (small)
    assert 0 <= rope < 0.02 * weights, (last[1].live, weights, plan.span)
    assert relay[1].live - last[1].live == plan.largest
    kv = 2 * args.num_layers * cfg.rollout.max_batch * args.num_kv_heads * args.head_dim * 4
    _, lp, steps = generate_shape(cfg, task, agents[0], args.max_seq_len)
    assert last[2].host >= last[1].live + kv * (lp + steps)
    long = torch_replica(resolve(cfg), task, 0, None, relay=False, prompt_tokens=args.max_seq_len - steps)
    assert long[2].host - last[2].host >= kv * (args.max_seq_len - lp - steps)    # the cache grows with the prompt


def test_the_replicas_generate_takes_the_tasks_longest_prompt():
    """generate_shape walks the task as preflight's length check does (full-length responses):
    the referential game's speaker sees 2 tokens and says 2, its listener sees those and 1 more."""
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.sim.torch_replica import generate_shape
    cfg = load_config(ROOT / "configs" / "local.yaml", SMALL_TORCH)
    task = build_task(cfg)
    assert generate_shape(cfg, task, "speaker", 64) == (0, 2, 2)
    assert generate_shape(cfg, task, "listener", 64) == (1, 3, 1)


def test_simulate_memory_checks_a_torch_pool_on_its_nodes_host_memory():
    """A torch-engine pool gets its replica's rows (host bytes, no device limit) and a node
    total against the pool's --mem, no longer "not checked"."""
    from flexmarl_hpc.sim.memory import memory_report
    text, code = memory_report(str(ROOT / "configs" / "local.yaml"), SMALL_TORCH, "npu64_a3", True,
                               only=("rollout",))
    out = json.loads(text)
    rows = [r for r in out["rows"] if r["component"] == "pool rollout"]
    assert [r["phase"] for r in rows] == ["engine start (torch engine)", "weight receive (torch engine)",
                                          "generate (torch engine)", "node total"]
    assert all(r["device_bytes"] == 0 and r["device_limit"] == 0 for r in rows)
    assert rows[-1]["node_host_bytes"] >= rows[2]["host_bytes"] > rows[1]["host_bytes"] > 0
    assert code == 0 and out["fits"]


def test_preflight_length_check_still_walks_every_turn():
    """check_lengths runs on turn_prompts (shared with generate_shape): a max_seq_len one
    short of a turn's prompt + budget is refused naming it."""
    import pytest
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.config.schema import ConfigError
    from flexmarl_hpc.launch.preflight import check_lengths
    from flexmarl_hpc.workflows.build import build_task
    cfg = load_config(ROOT / "configs" / "local.yaml", ["model.max_seq_len=4"])
    check_lengths(cfg, build_task(cfg))
    cfg = load_config(ROOT / "configs" / "local.yaml", ["model.max_seq_len=3"])
    with pytest.raises(ConfigError, match=r"model.max_seq_len: expected >= 4 \(turn 0 of agent 'speaker'"):
        check_lengths(cfg, build_task(cfg))


def test_a_checkpoints_slices_are_read_as_shapes_under_fake_tensors(tmp_path):
    """simulate memory builds a trainer from `model.checkpoint` under FakeTensorMode, where a
    tensor cannot be made from the file's bytes ('could not determine the shape of object
    type UntypedStorage' before): the reader gives each slice's shape and dtype from the
    header; outside the fake mode it reads the bytes."""
    import torch
    from safetensors.torch import save_file
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from flexmarl_hpc.learn.weights import checkpoint_reader
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    save_file({"w": w, "b": torch.ones(4, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    read = checkpoint_reader(tmp_path)
    assert torch.equal(read("w", 1, 2, 5), w[:, 2:5])
    with FakeTensorMode():
        rows, cols, whole = read("w", 0, 1, 3), read("w", 1, 2, 5), read("b")
    assert all(isinstance(t, FakeTensor) for t in (rows, cols, whole))
    assert (rows.shape, cols.shape, whole.shape) == ((2, 6), (4, 3), (4,))
    assert (rows.dtype, whole.dtype) == (torch.float32, torch.bfloat16)


def test_the_train_step_is_charged_the_tasks_longest_sequence_not_the_models_context():
    """A micro-batch is padded to its longest sequence: a turn workflow's longest prompt +
    budget (the preflight walk), not max_seq_len (a checkpoint's 8,192-token context charged
    784 GB to SmolLM2's 60-token task); an episode workflow's max_seq_len."""
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.sim.memory import train_tokens
    cfg = load_config(ROOT / "configs" / "local.yaml", ["model.max_seq_len=4096"])
    assert train_tokens(cfg, build_task(cfg), "listener", 4096) == 4
    assert train_tokens(cfg, build_task(cfg), "listener", 3) == 3
    paper = load_config(PAPER)
    assert train_tokens(paper, build_task(paper), "shop14_0", 8192) == 8192


def test_a_cpu_trainer_groups_training_memory_counts_on_its_nodes_ram():
    """A group without GPUs trains on its CPUs: its ranks' whole peak (what the table calls
    device) goes into the node's total against --mem, and no device limit applies (the
    SmolLM2 configs' trainer nodes read 0.0 GB against 2000M before)."""
    from flexmarl_hpc.sim.memory import memory_report
    text, _ = memory_report(str(ROOT / "configs" / "local.yaml"), ["trainer.backend=megatron"], "npu64_a3",
                            True, only=("group0",))
    rows = [r for r in json.loads(text)["rows"] if r["component"] == "group group0"]
    phases, node = rows[:-1], rows[-1]
    assert phases and all(r["device_limit"] == 0 for r in phases)
    assert node["phase"] == "node total"
    assert node["node_host_bytes"] >= max(r["device_bytes"] for r in phases) > 0     # the peak of the two together


def test_a_train_step_refusal_suggests_recompute_then_a_smaller_micro_batch():
    """Activations: recompute first; with recompute on, halve the micro-batch or cut it in more
    pipeline chunks. States (build, optimizer step): raise TP or PP. A save over: DDP buckets."""
    from flexmarl_hpc.sim.memory import trainer_remedy
    cfg = _paper()
    grp = cfg.trainer.named_groups[3]
    assert trainer_remedy(cfg, grp, "train step").startswith(
        "lower trainer.micro_batch_size (16 -> 8) or raise trainer.pipeline_microbatches (4)")
    none = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, recompute="none"))
    assert trainer_remedy(none, grp, "train step").startswith("turn on trainer.recompute: full (now none)")
    assert trainer_remedy(cfg, grp, "build") == ("raise group shop14_0's tensor_parallel or pipeline_parallel "
                                                 "(TP 4 x PP 1: each rank holds 1/(TP x PP) of the states)")
    assert trainer_remedy(cfg, grp, "checkpoint save").startswith("turn on trainer.overlap_grad_reduce")
    assert trainer_remedy(cfg, grp, "weight sync (send)").startswith("lower weight_sync.bucket_mb (1024)")


def test_vllm_starts_at_rollout_max_model_len_not_the_models_context():
    """vLLM's KV cache for one sequence is sized at rollout.max_model_len (within the model's
    max_seq_len), as rollout/vllm_engine.py passes it: a 32,768-token context's cache is 4x
    an 8,192-token one's."""
    from flexmarl_hpc.config.hf_config import ModelArgs
    from flexmarl_hpc.sim.memory import _engine_need
    args = ModelArgs(vocab_size=152064, hidden_size=5120, num_layers=64, num_heads=40, num_kv_heads=8,
                     intermediate_size=27648, max_seq_len=32768)
    kv = lambda n: 2 * 64 * 8 * 128 * n * 2 // 4                     # noqa: E731  K and V, bf16, TP 4
    assert _engine_need(args, 0, 4, 0.5, 8192) == int(kv(8192) / 0.5)
    assert _engine_need(args, 0, 4, 0.5) == int(kv(32768) / 0.5)
    assert _engine_need(args, 0, 4, 0.5, 65536) == int(kv(32768) / 0.5)     # capped at the model's


class _Bucket:
    def __init__(self, n):
        import torch
        self.grad_data = torch.empty(n, device="meta")


class _Buffer:
    def __init__(self, sizes):
        self.buckets = [_Bucket(n) for n in sizes]
        self.numel_unpadded = sum(sizes) - 8                               # padding between buckets


class _Saver:
    """What save_spike reads of a megatron trainer: its distributed optimizers' DDP buffers
    and its model's (bf16) parameters."""

    def __init__(self, sizes):
        import torch
        self.opt = type("O", (), {"buffers": [_Buffer(sizes)]})()
        self.model = torch.nn.Linear(10, 10, bias=False).to(torch.bfloat16)

    def _dist_optimizers(self):
        return [self.opt]


def test_the_checkpoint_save_spike_is_megatrons_gather_to_dp_rank_0():
    from flexmarl_hpc.sim.memory import save_spike
    tr = _Saver([1000, 400])
    world = 1400 - 8
    p = save_spike(tr, 50, 7, dp=4)                                     # DP rank 0: the gather's root
    assert (p.name, p.device_live, p.device) == ("checkpoint save", 50, 50)        # all on the host (gloo)
    assert p.host == 7 + 12 * world + 200 + 8 * 1000 + int(12 * 1000 / 4)   # world states, weights, copies
    other = save_spike(tr, 50, 7, dp=4, dp_rank=1)                      # its local shards and weights only
    assert other.host == 7 + 200 + int(12 * 1000 / 4)
    one = save_spike(tr, 50, 7, dp=1)                                   # dist_ckpt.py's DP-1 path
    assert (one.device, one.host) == (50, 7 + 12 * world + 200)


def test_the_report_states_each_allowance_and_the_checkpoints_vocabulary(tmp_path):
    """A Qwen2.5 checkpoint folder of headers only (scripts/qwen_headers.py, a sparse file):
    the report names its config.json's 152,064-token vocabulary, and each allowance's source."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("qwen_headers", ROOT / "scripts" / "qwen_headers.py")
    qh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qh)
    config = qh.make(tmp_path)                          # both folders, the paper config on them
    folder = tmp_path / "qwen2.5-14b-instruct"
    shards = [f.stat() for f in folder.glob("model-*-of-*.safetensors")]
    assert len(shards) == 8 and sum(f.st_size for f in shards) > 29e9         # its full size, sparse
    assert sum(f.st_blocks for f in shards) * 512 < 2**20                     # no bytes on disk
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.sim.memory import allowance_lines
    cfg = load_config(config)
    assert (cfg.model.max_seq_len, cfg.rollout.max_model_len) == (32768, 8192)   # config.json's context
    # the 14B pool's receive buffer is Qwen's embedding in bf16, larger than the 1 GiB bucket:
    # vLLM's fraction leaves that much (rollout/vllm_engine.memory_fraction), not a bucket
    import torch
    from flexmarl_hpc.config.hf_config import model_args
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.ranks.build import receive_span
    assert receive_span(cfg, [model_args(cfg, build_task(cfg), "shop14_0")], torch.bfloat16) == 152064 * 5120 * 2
    lines = allowance_lines(cfg)
    assert "CUDA context 0.67 GB a process (pytorch#86509" in lines[0] and "NVIDIA/nccl#964" in lines[0]
    assert lines[1:] == [f"vocabulary 152,064 ({tmp_path}/qwen2.5-32b-instruct/config.json): shop32_0, shop32_1, "
                         "shop32_2",
                         f"vocabulary 152,064 ({folder}/config.json): " + ", ".join(f"shop14_{i}" for i in range(7))]
