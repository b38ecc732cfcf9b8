"""sim.kvcache: continuous batching under a KV capacity, admission and recompute preemption,
against schedules worked out by hand."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flexmarl_hpc.sim.costs import AgentLayout, CostModel, QWEN25_14B, decode_schedule, kv_capacity_tokens
from flexmarl_hpc.sim.hardware import load_hardware
from flexmarl_hpc.sim.kvcache import kv_schedule


def test_with_room_to_spare_it_is_the_plain_schedule():
    lengths = np.random.default_rng(0).integers(1, 50, 40)
    active, held, again = kv_schedule(lengths, 7, 8, 10**9)
    plain = decode_schedule(lengths, 7, 8)
    assert active.tolist() == plain[0].tolist() and held.tolist() == plain[1].tolist() and again == 0


def test_a_full_cache_preempts_the_latest_admitted_which_re_prefills_later():
    """Two responses of 4 tokens after 1-token prompts, 8 tokens of cache: both run 3 steps
    (holding 2, 4, 6; then 8); the 4th step would need 10, so B (latest, 1 + 3 held) is
    preempted; A finishes alone (held 4); B is re-admitted with its 4 tokens re-prefilled
    and finishes (held 4)."""
    active, held, again = kv_schedule([4, 4], 1, 2, 8)
    assert active.tolist() == [2, 2, 2, 1, 1]
    assert held.tolist() == [2, 4, 6, 4, 4]
    assert again == 4


def test_the_latest_admitted_is_the_one_preempted():
    """A (6 tokens) then B (4), 1-token prompts, 8 of cache: 3 steps together (2, 4, 6), then
    B (1 + 3 held) goes; A runs its last 3 alone (4, 5, 6); B re-prefills 4 and ends (4).
    Preempting A instead would give B's step (held 4) before A's three."""
    active, held, again = kv_schedule([6, 4], 1, 2, 8)
    assert active.tolist() == [2, 2, 2, 1, 1, 1, 1] and held.tolist() == [2, 4, 6, 4, 5, 6, 4] and again == 4


def test_admission_waits_for_room_before_the_slots_run_out():
    """Cache of 6, prompts of 2, responses of 2, 8 slots: A (2 + 1 + 1 <= 6) and B (2 + 2 + 2
    <= 6) are admitted, C (4 + 2 + 3 > 6) waits. One step (held 4 -> 6); the next needs 8:
    B (2 + 1 held) is preempted, A ends alone (held 3); B comes back (3 re-prefilled), C still
    does not fit (3 + 2 + 2 > 6); B ends (held 3), then C runs alone (held 2, 3)."""
    active, held, again = kv_schedule([2, 2, 2], 2, 8, 6)
    assert active.tolist() == [2, 1, 1, 1, 1] and held.tolist() == [4, 3, 3, 2, 3] and again == 3


def test_a_response_longer_than_the_cache_is_refused_naming_the_sizes():
    with pytest.raises(ValueError, match="needs 11 tokens of KV cache, more than the replica's 10"):
        kv_schedule([9], 2, 4, 10)


def test_generate_pays_preemption_when_the_replica_cache_overflows():
    """A 14B replica on one 64 GB device holds ~143k tokens: 256 responses of 4096 after 2048-token
    prompts (1.57M tokens) overflow it and cost more than the same batch on a cache that fits."""
    hw = load_hardware("npu64_a3")
    one = CostModel(hw, {"a": AgentLayout(QWEN25_14B, gpus_per_replica=1, trainer_devices=16, max_num_seqs=256)})
    cap = kv_capacity_tokens(hw, one.layout("a"))
    assert 140_000 < cap < 150_000
    lengths = np.full(256, 4096)
    t = one.generate_s("a", 16, 2048, lengths)
    assert kv_schedule(lengths, 2048, 256, cap)[2] > 0               # preemptions happen
    big = dataclasses.replace(hw, hbm_gb=640.0)                       # the whole batch fits
    roomy = CostModel(big, {"a": AgentLayout(QWEN25_14B, gpus_per_replica=1, trainer_devices=16, max_num_seqs=256)})
    assert t > 1.5 * roomy.generate_s("a", 16, 2048, lengths)
