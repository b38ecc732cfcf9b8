"""Unit tests of the simulator's cost models and hardware profiles (pure arithmetic)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import yaml

from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc.sim.costs import (QWEN25_14B, QWEN25_32B, AgentLayout, CostModel, LengthDistribution,
                                    ModelShape, decode_schedule, decode_step_s, optimizer_s, prefill_s,
                                    shape_from_model_args, train_compute_s)
from flexmarl_hpc.sim.hardware import HARDWARE_DIR, HardwareError, load_hardware, save_hardware


def ideal(hw):
    """The profile at 100% of every peak and no fixed costs: figures become datasheet arithmetic."""
    eff = dataclasses.replace(hw.efficiency, mfu_prefill=1.0, mfu_decode=1.0, mfu_train=1.0, hbm=1.0,
                              link=1.0, collective_latency_s=0.0, bucket_latency_s=0.0,
                              decode_step_overhead_s=0.0, call_overhead_s=0.0)
    return dataclasses.replace(hw, efficiency=eff)


@pytest.fixture(scope="module")
def h100():
    return load_hardware("h100_ndr")


# --------------------------------------------------------------------------- profiles
@pytest.mark.parametrize("name", ["h100_ndr", "npu64_a3", "cpu_local"])
def test_every_shipped_profile_loads_and_every_number_has_a_comment(name):
    hw = load_hardware(HARDWARE_DIR / f"{name}.yaml")
    assert hw.name == name and hw.peak_flops > 0 and hw.hbm_bytes > 0
    lines = (HARDWARE_DIR / f"{name}.yaml").read_text().splitlines()
    figures = ("peak_bf16_tflops", "hbm_gb", "hbm_gb_s", "intra_node_gb_s", "nic_gb_s",
               "nics_per_node", "host_device_gb_s", "devices_per_node")
    for i, line in enumerate(lines):
        key = line.split(":")[0].strip()
        if key in figures and not line.startswith(" "):
            # the source (or, for cpu_local, why it is a guess) is on the line after a figure
            assert lines[i + 1].lstrip().startswith("#"), f"{name}: {key} has no source comment"


def test_h100_profile_is_the_datasheet(h100):
    assert h100.peak_flops == pytest.approx(989.4e12)       # dense bf16 (half the sparse 1979)
    assert h100.hbm_bandwidth == pytest.approx(3.35e12)
    assert h100.hbm_bytes == pytest.approx(80e9)
    assert h100.inter_node_bandwidth_per_device == pytest.approx(50e9)  # one NDR NIC per GPU
    assert h100.host_device_bandwidth == pytest.approx(64e9)            # PCIe Gen5 x16, one way


def test_paper_class_accelerator_has_64_gb_and_16_per_node():
    hw = load_hardware("npu64_a3")
    assert hw.hbm_gb == 64 and hw.devices_per_node == 16


def write_profile(tmp_path, **changes):
    raw = yaml.safe_load((HARDWARE_DIR / "h100_ndr.yaml").read_text())
    for key, value in changes.items():
        if key.startswith("efficiency."):
            raw["efficiency"][key.split(".", 1)[1]] = value
        elif value is None:
            raw.pop(key)
        else:
            raw[key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("change, field, expected", [
    ({"hbm_gb_s": -1.0}, "hbm_gb_s", "> 0"),
    ({"hbm_gb_s": "fast"}, "hbm_gb_s", "a number"),
    ({"peak_bf16_tflops": "1e15"}, "peak_bf16_tflops", "1.0e-5"),
    ({"devices_per_node": 8.5}, "devices_per_node", "an integer"),
    ({"nics_per_node": None}, "nics_per_node", "missing"),
    ({"hbm_tb_s": 3.35}, "hbm_tb_s", "unknown field"),
    ({"efficiency.mfu_train": 1.5}, "efficiency.mfu_train", "<= 1"),
    ({"efficiency.mfu_prefill": 0.0}, "efficiency.mfu_prefill", "> 0"),
    ({"efficiency.bucket_latency_s": -0.1}, "efficiency.bucket_latency_s", ">= 0"),
    ({"efficiency.warp_speed": 2.0}, "warp_speed", "unknown field"),
])
def test_bad_profile_names_file_and_field(tmp_path, change, field, expected):
    path = write_profile(tmp_path, **change)
    with pytest.raises(HardwareError) as e:
        load_hardware(path)
    msg = str(e.value)
    assert str(path) in msg and field in msg and expected in msg, msg


def test_missing_or_broken_file_is_one_clear_error(tmp_path):
    with pytest.raises(HardwareError, match="cannot read"):
        load_hardware(tmp_path / "nope.yaml")
    (tmp_path / "x.yaml").write_text("name: [unclosed")
    with pytest.raises(HardwareError, match="not valid YAML"):
        load_hardware(tmp_path / "x.yaml")
    (tmp_path / "y.yaml").write_text("- a list\n")
    with pytest.raises(HardwareError, match="expected a mapping"):
        load_hardware(tmp_path / "y.yaml")


def test_saved_profile_round_trips_and_a_bad_one_is_not_written(tmp_path, h100):
    fitted = dataclasses.replace(h100, name="fitted", efficiency=dataclasses.replace(
        h100.efficiency, mfu_train=0.123, call_overhead_s=2.5e-3))
    path = save_hardware(fitted, tmp_path / "fitted.yaml", header="fitted by a test\nsecond line")
    assert load_hardware(path) == fitted
    assert path.read_text().startswith("# fitted by a test\n# second line\n")
    bad = dataclasses.replace(fitted, hbm_gb_s=0.0)
    with pytest.raises(HardwareError, match="hbm_gb_s"):
        save_hardware(bad, path)
    assert load_hardware(path) == fitted                      # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fitted.yaml"]


# --------------------------------------------------------------------------- shapes
def test_qwen_params_are_derived_from_the_published_shapes():
    # The HF model cards round to "32.5B" / "14.7B"; the architecture gives these exactly.
    assert QWEN25_32B.params == 32_763_876_352
    assert QWEN25_14B.params == 14_770_033_664
    assert QWEN25_14B.weight_bytes == 2 * QWEN25_14B.params
    # 2 (K and V) x 48 layers x 8 KV heads x 128 dims x 2 bytes
    assert QWEN25_14B.kv_bytes_per_token == 2 * 48 * 8 * 128 * 2


@pytest.mark.parametrize("tie, bias", [(False, True), (True, False)])
def test_params_match_the_projects_own_model(tie, bias):
    from flexmarl_hpc.learn.model import ModelArgs, build_model      # torch: a hard dependency, never skipped
    args = ModelArgs(vocab_size=37, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=96, max_seq_len=16, tie_embeddings=tie, qkv_bias=bias)
    net = build_model(args, seed=0)
    shape = shape_from_model_args(args, bytes_per_param=4)
    assert shape.params == sum(p.numel() for p in net.parameters())
    assert shape.weight_bytes == sum(p.numel() * p.element_size() for p in net.parameters())


def test_bad_shape_names_the_field():
    with pytest.raises(ValueError, match="'kv_heads'"):
        ModelShape("m", hidden=64, layers=2, heads=4, kv_heads=0, intermediate=8, vocab=10)
    with pytest.raises(ValueError, match="divide"):
        ModelShape("m", hidden=64, layers=2, heads=4, kv_heads=3, intermediate=8, vocab=10)


# --------------------------------------------------------------------------- rollout
def test_decode_of_14b_at_batch_1_is_weights_over_bandwidth(h100):
    hw = ideal(h100)
    step = float(decode_step_s(hw, QWEN25_14B, 1, 0))
    assert step == pytest.approx(QWEN25_14B.weight_bytes / 3.35e12)
    assert 8.0e-3 < step < 9.5e-3                            # ~29.5 GB / 3.35 TB/s ~ 8.8 ms
    # KV read adds bytes: 4096 cached tokens x 196,608 B = 0.8 GB -> ~0.24 ms
    more = float(decode_step_s(hw, QWEN25_14B, 1, 4096))
    assert more - step == pytest.approx(4096 * QWEN25_14B.kv_bytes_per_token / 3.35e12)
    # the stated efficiencies only slow it down
    assert float(decode_step_s(h100, QWEN25_14B, 1, 0)) > step


def test_decode_is_memory_bound_then_compute_bound(h100):
    hw = ideal(h100)
    small = decode_step_s(hw, QWEN25_14B, np.array([1, 8, 64]), 0)
    assert np.allclose(small, small[0])                   # weights dominate: batch is ~free
    ridge = 3.35e12 / 989.4e12 * QWEN25_14B.bytes_per_param * QWEN25_14B.params / (2 * QWEN25_14B.params)
    b = int(4 / ridge)                                    # well past the roofline ridge (~295 FLOP/B)
    big = float(decode_step_s(hw, QWEN25_14B, b, 0))
    assert big == pytest.approx(2 * QWEN25_14B.params * b / 989.4e12)


def test_tensor_parallel_divides_decode_and_adds_allreduce(h100):
    hw = ideal(h100)
    one = float(decode_step_s(hw, QWEN25_32B, 1, 0, g=1))
    four = float(decode_step_s(hw, QWEN25_32B, 1, 0, g=4))
    assert four > one / 4                                 # the all-reduce term is there
    assert four == pytest.approx(one / 4, rel=0.01)       # and small at batch 1 with no latency
    lat = ideal(h100)
    lat = dataclasses.replace(lat, efficiency=dataclasses.replace(lat.efficiency, collective_latency_s=1e-5))
    with_lat = float(decode_step_s(lat, QWEN25_32B, 1, 0, g=4))
    assert with_lat - four == pytest.approx(2 * 64 * 1e-5)  # 2 all-reduces per layer


def test_prefill_is_two_flops_per_param_per_token(h100):
    hw = ideal(h100)
    tokens = 64 * 1024
    assert prefill_s(hw, QWEN25_32B, tokens) == pytest.approx(2 * QWEN25_32B.params * tokens / 989.4e12)
    eff = prefill_s(h100, QWEN25_32B, tokens)
    assert eff == pytest.approx(prefill_s(hw, QWEN25_32B, tokens) / h100.efficiency.mfu_prefill)
    # one short prompt still reads every weight once
    assert prefill_s(hw, QWEN25_32B, 1) == pytest.approx(QWEN25_32B.weight_bytes / 3.35e12)


def test_decode_schedule_counts_tokens_exactly():
    lengths = np.array([3, 1, 2])
    active, held = decode_schedule(lengths, prompt_tokens=10, slots=8)
    assert active.tolist() == [3, 2, 1]
    assert held.tolist() == [30, 11 + 11, 12]
    # two slots: the third response (2 tokens) starts at step 1 when the 1-token one is done
    active, held = decode_schedule(lengths, prompt_tokens=10, slots=2)
    assert active.tolist() == [2, 2, 2]
    assert held.tolist() == [10 + 10, 11 + 10, 12 + 11]
    assert active.sum() == lengths.sum()


def test_generate_is_bounded_by_the_longest_response(h100):
    cm = CostModel(h100, {"a": AgentLayout(QWEN25_14B, trainer_devices=8)})
    short = cm.generate_s("a", 8, 256, 100)
    same_total = cm.generate_s("a", 8, 256, [800] + [1] * 7)
    assert same_total > 5 * short                         # a straggler sets the time, not the sum
    assert cm.generate_s("a", 8, 256, [100] * 8) == pytest.approx(short)
    assert cm.generate_s("a", 8, 256, 0) == pytest.approx(prefill_s(h100, QWEN25_14B, 8 * 256))
    # per-prompt lengths: prefill of their sum, decode from their mean
    mixed = cm.generate_s("a", 2, [100, 300], [50, 50])
    assert mixed == pytest.approx(cm.generate_s("a", 2, 200, [50, 50]))
    assert cm.generate_s("a", 2, [100, 300], 0) == pytest.approx(prefill_s(h100, QWEN25_14B, 400))
    with pytest.raises(ValueError, match="3 prompt lengths for n_prompts=2"):
        cm.generate_s("a", 2, [1, 2, 3], 5)
    with pytest.raises(ValueError, match="response lengths"):
        cm.generate_s("a", 1, 1, [-1])
    with pytest.raises(KeyError, match="no agent 'b'"):
        cm.generate_s("b", 1, 1, 1)


def test_kv_capacity_limits_concurrency(h100):
    # 32B on one 80 GB GPU: 65.5 GB of weights leave ~6.5 GB of KV = ~25k tokens of 262 kB
    lay = AgentLayout(QWEN25_32B, gpus_per_replica=1, trainer_devices=16)
    cm = CostModel(h100, {"a": lay})
    roomy = CostModel(h100, {"a": dataclasses.replace(lay, gpus_per_replica=2)})
    lengths = [4000] * 64
    one, two = cm.generate_s("a", 64, 100, lengths), roomy.generate_s("a", 64, 100, lengths)
    assert one > 4 * two                                  # waves of ~6 sequences vs all 64 at once


def test_model_that_does_not_fit_is_refused(h100):
    with pytest.raises(ValueError, match="gpus_per_replica.*does not fit"):
        CostModel(load_hardware("npu64_a3"), {"a": AgentLayout(QWEN25_32B, gpus_per_replica=1)})
    with pytest.raises(ValueError, match="trainer_devices"):
        CostModel(h100, {"a": AgentLayout(QWEN25_32B, gpus_per_replica=1, trainer_devices=2)})
    with pytest.raises(ValueError, match="multiple of trainer_tp"):
        CostModel(h100, {"a": AgentLayout(QWEN25_14B, trainer_devices=8, trainer_tp=3)})


# --------------------------------------------------------------------------- training
def test_train_step_is_six_flops_per_param_per_token(h100):
    hw = ideal(h100)
    lay = AgentLayout(QWEN25_14B, trainer_devices=8)
    tokens = 16 * 4096
    assert train_compute_s(hw, lay, tokens) == pytest.approx(6 * QWEN25_14B.params * tokens / (8 * 989.4e12))


def test_full_recompute_runs_the_forward_again(h100):
    """Full recompute: 8 FLOPs per param and token, 6 TP all-reduces per layer (4 + the forward's
    2 again); block recompute of 12 of a stage's 24 layers: half of that extra; the config's
    trainer.recompute reaches the cost model; a fraction outside [0, 1] names the field."""
    from flexmarl_hpc.sim.costs import recompute_fraction
    hw = ideal(h100)
    lay = AgentLayout(QWEN25_14B, trainer_devices=8)
    tokens = 16 * 4096
    full = dataclasses.replace(lay, recompute=1.0)
    assert train_compute_s(hw, full, tokens) == pytest.approx(8 / 6 * train_compute_s(hw, lay, tokens))
    tp2 = dataclasses.replace(lay, trainer_tp=2)
    a, b = (train_compute_s(h100, dataclasses.replace(tp2, recompute=r), 1) for r in (0.0, 1.0))
    assert b - 8 / 6 * a == pytest.approx((6 - 8 / 6 * 4) * 48 * 1e-5, abs=2e-6)   # 1 token: the latencies
    assert recompute_fraction("full", "uniform", 2, 48, 2) == 1.0
    assert recompute_fraction("full", "block", 12, 48, 2) == 0.5
    assert recompute_fraction("selective", "uniform", 1, 48, 1) == recompute_fraction("none", "uniform", 1, 48, 1) == 0
    with pytest.raises(ValueError, match="field 'recompute'"):
        CostModel(h100, {"a": dataclasses.replace(lay, recompute=2.0)})
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.sim.driver import cost_model
    from tests.conftest import ROOT
    npu = load_hardware("npu64_a3")
    mix = load_config(str(ROOT / "configs/paper_3x32b_7x14b.yaml"), ["run.output_dir=/nonexistent"])
    assert mix.trainer.recompute == "full" and cost_model(resolve(mix), npu).layout("shop32_0").recompute == 1.0
    none = load_config(str(ROOT / "configs/paper_3x32b_7x14b.yaml"), ["run.output_dir=/nonexistent", "trainer.recompute=none"])
    assert cost_model(resolve(none), npu).layout("shop32_0").recompute == 0.0


def test_train_scales_linearly_in_tokens_and_inversely_in_devices(h100):
    lay8 = AgentLayout(QWEN25_14B, trainer_devices=8, trainer_tp=2)
    lay16 = dataclasses.replace(lay8, trainer_devices=16)
    hw = ideal(h100)
    t1, t2 = train_compute_s(hw, lay8, 50_000), train_compute_s(hw, lay8, 100_000)
    assert t2 == pytest.approx(2 * t1)
    assert train_compute_s(hw, lay16, 100_000) == pytest.approx(t1)    # same tokens per DP rank
    # with the stated latencies it is affine: the TP all-reduces' fixed cost per layer stays
    a, b, c = (train_compute_s(h100, lay8, n) for n in (50_000, 100_000, 150_000))
    assert b - a == pytest.approx(c - b) and 2 * a - b == pytest.approx(4 * 48 * 1e-5)
    cm = CostModel(h100, {"a": lay8})
    assert cm.train_s("a", 50_000, optimizer_step=False) == pytest.approx(a)
    assert cm.train_s("a", 50_000) == pytest.approx(a + optimizer_s(h100, lay8))


def test_optimizer_is_a_memory_bound_adam_over_the_shard(h100):
    hw = ideal(h100)
    lay = AgentLayout(QWEN25_14B, trainer_devices=8, trainer_tp=8)   # dp = 1: no gradient reduce
    assert optimizer_s(hw, lay) == pytest.approx(30 * QWEN25_14B.params / 8 / 3.35e12)
    dp = AgentLayout(QWEN25_14B, trainer_devices=8)                  # dp = 8 over NVLink
    grads = 2 * QWEN25_14B.params
    assert optimizer_s(hw, dp) - optimizer_s(hw, lay) == pytest.approx(2 * 7 / 8 * grads / 450e9)
    across = AgentLayout(QWEN25_14B, trainer_devices=16, trainer_tp=2)  # dp = 8 across 2 nodes
    assert optimizer_s(hw, across) > optimizer_s(hw, dp)


# --------------------------------------------------------------------------- sync and swap
def test_sync_is_bytes_over_the_link_plus_bucket_latency(h100):
    lay = AgentLayout(QWEN25_14B, trainer_devices=8, bucket_bytes=2**30)
    cm = CostModel(h100, {"a": lay, "b": dataclasses.replace(lay, sync_link="intra_node")})
    nbytes = cm.weight_bytes("a")
    buckets = math.ceil(nbytes / 2**30)
    expect = nbytes / (50e9 * h100.efficiency.link) + buckets * h100.efficiency.bucket_latency_s
    assert cm.sync_s("a", nbytes) == pytest.approx(expect)
    assert cm.sync_s("b", nbytes) < cm.sync_s("a", nbytes)          # NVLink beats one NIC
    assert cm.sync_s("a", 0) == 0.0


def test_swap_moves_state_over_pcie_of_every_device(h100):
    lay = AgentLayout(QWEN25_14B, trainer_devices=8)
    cm = CostModel(ideal(h100), {"a": lay, "n": dataclasses.replace(lay, swap_link="inter_node")})
    nbytes = cm.state_bytes("a")
    assert nbytes == 14 * QWEN25_14B.params
    assert cm.swap_s("a", nbytes) == pytest.approx(nbytes / (8 * 64e9))
    assert cm.swap_s("n", nbytes) == pytest.approx(nbytes / (8 * 50e9))


# --------------------------------------------------------------------------- lengths
def test_lengths_are_seeded_long_tailed_and_clipped():
    dist = LengthDistribution(median=1024, sigma=0.8, max_tokens=8192)
    a = dist.sample(np.random.default_rng(7), 20_000)
    b = dist.sample(np.random.default_rng(7), 20_000)
    assert (a == b).all() and a.dtype == np.int64
    assert a.max() == 8192 and a.min() >= 1
    assert np.median(a) == pytest.approx(1024, rel=0.05)
    assert a.mean() > np.median(a) * 1.2                    # right tail
    assert 0.001 < (a == 8192).mean() < 0.02                # ~0.5% at the cap
    assert (LengthDistribution(median=300, sigma=0).sample(np.random.default_rng(0), 5) == 300).all()
    with pytest.raises(ValueError, match="max_tokens"):
        LengthDistribution(min_tokens=10, max_tokens=5)
