"""Hardware profiles for the cost model: typed, validated, loaded from configs/hardware/*.yaml.

A profile holds the vendor figures of one node kind (each sourced in a comment of its YAML
file) and an `efficiency:` section of stated assumptions (MFU, achievable fraction of
bandwidth, fixed latencies) that calibration may refit. YAML fields use human units
(TFLOP/s, GB, GB/s, decimal); the properties give SI units (FLOP/s, bytes, bytes/s).

    hw = load_hardware("configs/hardware/h100_ndr.yaml")
    hw.hbm_bandwidth        # 3.35e12 bytes/s
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"


class HardwareError(ValueError):
    """A hardware profile field or file is wrong; the message names both and what was expected."""


@dataclass(frozen=True)
class Efficiency:
    """Assumed achieved fractions of peak and fixed costs (not vendor figures)."""

    mfu_prefill: float = 0.5
    """Fraction of dense peak FLOP/s reached by prefill (compute-bound)."""
    mfu_decode: float = 0.5
    """Fraction of peak reached by decode once it turns compute-bound (large batches)."""
    mfu_train: float = 0.4
    """Model FLOPs utilisation of a trainer step (6 x params x tokens counted)."""
    hbm: float = 0.8
    """Fraction of peak HBM bandwidth a memory-bound kernel reaches."""
    link: float = 0.8
    """Fraction of peak link bandwidth a collective or transfer reaches (NVLink, NIC, PCIe)."""
    collective_latency_s: float = 1e-5
    """Fixed cost of one small tensor-parallel all-reduce, seconds."""
    bucket_latency_s: float = 5e-4
    """Fixed cost of one weight-sync bucket (collective launch, bookkeeping), seconds."""
    decode_step_overhead_s: float = 1e-3
    """Fixed cost of one decode step of a replica (scheduler, kernel launches), seconds."""
    call_overhead_s: float = 0.0
    """Fixed cost of one generate or train call, seconds."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory a replica may use for weights plus KV cache (vLLM's knob)."""
    orchestrator_s: float = 0.0
    """The orchestrator's own seconds per reply it handles (schedule, store, log): 0 models
    an orchestrator that costs nothing; `simulate calibrate` fits it on CPU runs."""
    optimizer_overhead_s: float = 0.0
    """Fixed seconds of one optimizer step beyond its memory-bound update (on CPU: torch's
    per-tensor dispatch of Adam, which no bandwidth explains); 0 by default; fitted on CPU runs."""
    orchestrator_step_s: float = 0.0
    """The orchestrator's own seconds per agent optimizer step it receives (its step-end
    metrics, log and commit): 0 by default; fitted on CPU runs."""
    message_latency_s: float = 0.0
    """One-way latency of a command or reply between the orchestrator and a worker (MPI
    send, the worker's receive loop), seconds; fitted on CPU runs."""
    shared_cores: int = 0
    """Cores the worker ranks share (0: each rank has its device to itself). With N > 0,
    generate and train commands share N cores (processor sharing: while ranks computing w in
    all run, each runs at min(1, N / w) of a core while w < N, and at N / (w + waiting_share
    x polling ranks) once they fill the cores; sim/cores.py), as on the 2-core machine of
    the calibration runs."""
    orchestrator_byte_s: float = 0.0
    """The orchestrator's own seconds per byte of a command it sends or a reply it handles
    (pickling, MPI copy, store write), on top of `orchestrator_s`."""
    nodes_per_leaf: int = 16
    """Nodes under one leaf switch of the two-level fat tree (sim/network.py)."""
    oversubscription: float = 1.0
    """A leaf switch's downlink : uplink bandwidth (1: non-blocking)."""
    broadcast: str = "ring"
    """How a weight sync reaches its replicas: `ring` (pipelined chain, NCCL's choice for large
    broadcasts) or `tree` (binary; inner nodes send twice)."""
    waiting_share: float = 0.0
    """Share of a core each polling rank takes from those computing once `shared_cores` are
    full (its back-off wake-ups preempt them; which ranks poll follows run.idle_wait);
    measured by bench/bench_cores.py --pollers, not fitted."""
    external_cores: float = 0.0
    """Cores other processes kept busy while the run ran (a shared machine's load, measured
    per run by sim/hostload.py, not fitted): the ranks share `shared_cores` minus it. 0 for a
    profile, which describes the machine unloaded; set per run by the calibration."""

    def rank_cores(self) -> float:
        """The cores the ranks share (0: each rank has its device to itself)."""
        return self.shared_cores - self.external_cores if self.shared_cores else 0.0


_FRACTIONS = ("mfu_prefill", "mfu_decode", "mfu_train", "hbm", "link", "gpu_memory_utilization")


@dataclass(frozen=True)
class HardwareProfile:
    """One node kind: `devices_per_node` accelerators and the links between them."""

    name: str
    """Short name (the file's stem by convention)."""
    accelerator: str
    """What one device is, in words."""
    devices_per_node: int
    """Accelerators per node."""
    peak_bf16_tflops: float
    """Dense (no sparsity) bf16 peak per device, TFLOP/s."""
    hbm_gb: float
    """Device memory capacity, GB (1e9 bytes)."""
    hbm_gb_s: float
    """Device memory bandwidth, GB/s."""
    intra_node_gb_s: float
    """Device-to-device bandwidth inside a node per device and direction (NVLink/HCCS), GB/s."""
    nic_gb_s: float
    """Bandwidth of one inter-node NIC per direction, GB/s."""
    nics_per_node: int
    """Inter-node NICs per node (compute fabric only)."""
    host_device_gb_s: float
    """Host <-> device bandwidth per device and direction (PCIe), GB/s."""
    efficiency: Efficiency = field(default_factory=Efficiency)
    """Assumed efficiencies and fixed costs (see `Efficiency`)."""

    @property
    def peak_flops(self) -> float:
        return self.peak_bf16_tflops * 1e12

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def hbm_bandwidth(self) -> float:
        return self.hbm_gb_s * 1e9

    @property
    def intra_node_bandwidth(self) -> float:
        return self.intra_node_gb_s * 1e9

    @property
    def inter_node_bandwidth_per_device(self) -> float:
        """A device's share of its node's NICs, bytes/s (all devices sending at once)."""
        return self.nic_gb_s * 1e9 * self.nics_per_node / self.devices_per_node

    @property
    def host_device_bandwidth(self) -> float:
        return self.host_device_gb_s * 1e9


def _check_number(value: Any, where: str, *, integer: bool = False,
                  lo: float = 0.0, hi: float = math.inf, lo_open: bool = True) -> float:
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        hint = ""
        if isinstance(value, str):
            try:
                float(value)
                hint = " (YAML reads 1e-5 as a string: write 1.0e-5)"
            except ValueError:
                pass
        raise HardwareError(f"{where}: expected {kind}, got {value!r}{hint}")
    bad_lo = value <= lo if lo_open else value < lo
    if not math.isfinite(value) or bad_lo or value > hi:
        lo_s = f"> {lo:g}" if lo_open else f">= {lo:g}"
        hi_s = f" and <= {hi:g}" if hi != math.inf else ""
        raise HardwareError(f"{where}: expected {kind} {lo_s}{hi_s}, got {value!r}")
    return value


def _check_keys(raw: dict, cls: type, where: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise HardwareError(f"{where}: unknown field {unknown[0]!r}; expected one of {sorted(names)}")


def _check_special(key: str, v: Any, where: str) -> bool:
    """Check the efficiency fields that are not plain non-negative numbers; False for others."""
    if key == "broadcast":
        if v not in ("ring", "tree"):
            raise HardwareError(f"{where}: field 'efficiency.broadcast': expected ring or tree, got {v!r}")
    elif key == "nodes_per_leaf":
        _check_number(v, f"{where}: field 'efficiency.nodes_per_leaf'", integer=True)
    elif key == "oversubscription":
        _check_number(v, f"{where}: field 'efficiency.oversubscription'", lo=1.0, lo_open=False)
    else:
        return False
    return True


def validate_efficiency(eff: Efficiency, where: str) -> None:
    for f in dataclasses.fields(eff):
        v = getattr(eff, f.name)
        if _check_special(f.name, v, where):
            continue
        if f.name in _FRACTIONS:
            _check_number(v, f"{where}: field 'efficiency.{f.name}'", hi=1.0)
        else:
            _check_number(v, f"{where}: field 'efficiency.{f.name}'", lo_open=False)
    if eff.external_cores and not eff.shared_cores:
        raise HardwareError(f"{where}: field 'efficiency.external_cores': expected 0 without "
                            f"shared_cores (it is load on shared cores), got {eff.external_cores!r}")
    if eff.shared_cores and eff.external_cores >= eff.shared_cores:
        raise HardwareError(f"{where}: field 'efficiency.external_cores': expected < shared_cores "
                            f"({eff.shared_cores}), got {eff.external_cores!r}")


def validate_hardware(hw: HardwareProfile, where: str = "hardware profile") -> HardwareProfile:
    """Raise HardwareError naming `where` and the first bad field; return `hw` when sound."""
    for name in ("name", "accelerator"):
        if not isinstance(getattr(hw, name), str) or not getattr(hw, name):
            raise HardwareError(f"{where}: field {name!r}: expected a non-empty string, "
                                f"got {getattr(hw, name)!r}")
    for f in dataclasses.fields(hw):
        if f.name in ("name", "accelerator", "efficiency"):
            continue
        _check_number(getattr(hw, f.name), f"{where}: field {f.name!r}",
                      integer=f.name in ("devices_per_node", "nics_per_node"))
    validate_efficiency(hw.efficiency, where)
    return hw


def hardware_from_dict(raw: Any, where: str) -> HardwareProfile:
    """Build and validate a profile from parsed YAML; `where` names the source in errors."""
    if not isinstance(raw, dict):
        raise HardwareError(f"{where}: expected a mapping of profile fields, got {type(raw).__name__}")
    _check_keys(raw, HardwareProfile, where)
    missing = [f.name for f in dataclasses.fields(HardwareProfile)
               if f.name != "efficiency" and f.name not in raw]
    if missing:
        raise HardwareError(f"{where}: field {missing[0]!r} is missing")
    eff_raw = raw.get("efficiency") or {}
    if not isinstance(eff_raw, dict):
        raise HardwareError(f"{where}: field 'efficiency': expected a mapping, got {eff_raw!r}")
    _check_keys(eff_raw, Efficiency, f"{where}: field 'efficiency'")
    # Type checks run before construction so a string never reaches arithmetic.
    for key, value in eff_raw.items():
        if not _check_special(key, value, where):
            _check_number(value, f"{where}: field 'efficiency.{key}'", lo_open=key in _FRACTIONS)
    hw = HardwareProfile(**{**raw, "efficiency": Efficiency(**eff_raw)})
    return validate_hardware(hw, where)


def load_hardware(path: str | Path) -> HardwareProfile:
    """Load configs/hardware/<name>.yaml (a bare name looks there)."""
    p = Path(path)
    if not p.suffix and not p.exists():
        p = HARDWARE_DIR / f"{p.name}.yaml"
    try:
        text = p.read_text()
    except OSError as e:
        raise HardwareError(f"{p}: cannot read hardware profile ({e.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise HardwareError(f"{p}: not valid YAML ({e})") from None
    return hardware_from_dict(raw, str(p))


def save_hardware(hw: HardwareProfile, path: str | Path, header: str = "") -> Path:
    """Write `hw` as a profile YAML atomically (temp file + rename: a crash leaves the old file
    or the new one, never half of one); `header` becomes comment lines (say where the figures
    come from, e.g. "fitted by simulate --calibrate RUN.h5")."""
    validate_hardware(hw, str(path))
    p = Path(path)
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    body = yaml.safe_dump(dataclasses.asdict(hw), sort_keys=False)
    from flexmarl_hpc.store.checkpoint import replace_file
    replace_file(p, "\n".join(lines + [body]).encode())
    return p
