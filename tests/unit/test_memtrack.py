"""sim/fake_memory.py counts what a real run would hold: meta tensors (the whole model built on
meta for its names and shapes, as learn.model.init_tensors does) hold nothing. Counting them
made the paper's 32B TP 8 x PP 2 build read 128.7 GB, the whole model in fp32."""
from __future__ import annotations

import torch


def test_meta_tensors_count_nothing():
    from flexmarl_hpc.learn.model import CausalLM, ModelArgs
    from flexmarl_hpc.sim import fake_memory as memtrack
    with memtrack.track() as c, memtrack.device_scope():
        with torch.device("meta"):
            m = CausalLM(ModelArgs(1000, 64, 2, 4, 2, 128, 64))
        x = torch.empty(1000)
        assert c.live["device"] == 4000 and c.peak["device"] == 4000      # only x
        del m, x
    assert c.live["device"] == 0


def test_a_random_init_draw_holds_one_full_tensor_at_a_time():
    """init_tensors (a sharded build's random init) peaks at its largest tensor, the
    embedding, not the model: what a real run holds."""
    from flexmarl_hpc.learn.model import ModelArgs, init_tensors
    from flexmarl_hpc.sim import fake_memory as memtrack
    args = ModelArgs(50_000, 512, 4, 8, 2, 1536, 256)
    with memtrack.track() as c, memtrack.device_scope():
        for _name, t in init_tensors(args, 0):
            del t
    embedding = 50_000 * 512 * 4
    assert c.live["device"] == 0
    assert embedding <= c.peak["device"] <= embedding + 1536 * 512 * 4


def test_a_sharded_builds_slices_land_on_the_device():
    """init_reader keeps each slice with `.to(dist.device(), copy=True)`: on a GPU that is the
    device; here device() is "cpu", and `track()` must not read it as a host copy (it did:
    the 32B build showed its whole shard as host bytes). In megatron's scope, as the build."""
    from flexmarl_hpc.learn.model import ModelArgs
    from flexmarl_hpc.learn.weights import WeightSource
    from flexmarl_hpc.sim import fake_memory as memtrack
    from flexmarl_hpc.trainer.megatron import dist, trainer
    args = ModelArgs(1000, 64, 2, 4, 2, 128, 64, tie_embeddings=False)
    with memtrack.track() as c, memtrack.device_scope():
        assert trainer.device() is memtrack.ON_DEVICE and dist.device() is memtrack.ON_DEVICE
        shard = WeightSource().shard(args, 1, 2, 1, 2, device=trainer.device())
        nbytes = sum(v.untyped_storage().nbytes() for v in shard.values())
        assert c.live == {"device": nbytes, "host": 0, "all": nbytes}
    assert trainer.device() == torch.device("cpu") and trainer.device() is not memtrack.ON_DEVICE
