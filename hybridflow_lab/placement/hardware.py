"""Hardware profiles for the placement simulator: per-device rates, memory and links.

GPU profiles use datasheet figures (dense bf16 tensor-core FLOP/s, HBM bandwidth, NVLink bandwidth
per direction, memory) scaled by achieved fractions typical of Megatron-style training and of
memory-bound decoding. The CPU profile describes this machine: its rates come from
``hybridflow-lab plan --calibrate`` (measured on the tiny and small models) and are saved as JSON.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class HardwareProfile:
    """One device kind. Rates are per device; ``cores`` > 0 means devices share that many CPU cores."""

    name: str
    memory_bytes: float
    flops: float  # peak dense FLOP/s at the workload's dtype
    memory_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s per device, one direction (NVLink; shared memory on CPU)
    inter_node_bandwidth: float  # bytes/s per device, one direction (InfiniBand)
    devices_per_node: int = 8
    train_efficiency: float = 0.45  # achieved fraction of ``flops`` in training (forward + backward)
    infer_efficiency: float = 0.55  # in forward-only passes (log-probs, values, prefill)
    bandwidth_efficiency: float = 0.75  # achieved fraction of ``memory_bandwidth`` while decoding
    decode_step_overhead_s: float = 0.0  # fixed cost per decoding step (kernel launches, Python)
    call_overhead_s: float = 0.0  # fixed cost per stage call on a model (dispatch, collection)
    step_overhead_s: float = 0.0  # the controller's own work per iteration (rewards, advantages, batching)
    collective_latency_s: float = 0.0  # per collective call
    cores: int = 0  # > 0: the devices share this many cores, so busy devices beyond it slow each other down

    def link_bandwidth(self, devices: int) -> float:
        """Per-device bandwidth of a collective over ``devices`` consecutive devices."""
        return self.intra_node_bandwidth if devices <= self.devices_per_node else self.inter_node_bandwidth

    def share(self, busy_devices: float) -> float:
        """The fraction of a device's rate left when ``busy_devices`` run at once, on average (1 unless cores are
        shared)."""
        if self.cores <= 0 or busy_devices <= self.cores:
            return 1.0
        return self.cores / busy_devices

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        return cls(**json.loads(Path(path).read_text()))


GB = 1e9
GIB = 2**30
# Datasheet figures: dense bf16 FLOP/s, HBM bytes/s, NVLink bytes/s per direction; 200 Gb/s InfiniBand per GPU.
PROFILES = {
    "a100-80gb": HardwareProfile("a100-80gb", 80 * GIB, 312e12, 2039 * GB, 300 * GB, 25 * GB,
                                 decode_step_overhead_s=2e-3, call_overhead_s=0.05, collective_latency_s=2e-5),
    "h100": HardwareProfile("h100", 80 * GIB, 989e12, 3350 * GB, 450 * GB, 50 * GB,
                            decode_step_overhead_s=1.5e-3, call_overhead_s=0.05, collective_latency_s=2e-5),
    "h800": HardwareProfile("h800", 80 * GIB, 989e12, 3350 * GB, 200 * GB, 50 * GB,
                            decode_step_overhead_s=1.5e-3, call_overhead_s=0.05, collective_latency_s=2e-5),
    "h200": HardwareProfile("h200", 141 * GIB, 989e12, 4800 * GB, 450 * GB, 50 * GB,
                            decode_step_overhead_s=1.5e-3, call_overhead_s=0.05, collective_latency_s=2e-5),
    # This machine before calibration: 2 cores shared by every rank, float32.
    "cpu": HardwareProfile("cpu", 4 * GIB, 60e9, 10 * GB, 2 * GB, 2 * GB, devices_per_node=64, train_efficiency=0.5,
                           infer_efficiency=0.6, bandwidth_efficiency=0.5, decode_step_overhead_s=2e-3,
                           call_overhead_s=0.02, collective_latency_s=2e-4, cores=2),
}


def get_profile(name_or_path: str) -> HardwareProfile:
    """A named profile (``a100-80gb``, ``h100``, ``h800``, ``h200``, ``cpu``) or a calibrated profile's JSON file."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if path.is_file():
        return HardwareProfile.load(path)
    raise ValueError(f"unknown hardware profile {name_or_path!r}; profiles: {', '.join(PROFILES)}, or a JSON file "
                     "written by `hybridflow-lab plan --calibrate`")



def machine_profile(devices: int) -> HardwareProfile:
    """This machine: its GPU's memory with the nearest named profile's rates, or its RAM shared by ``devices``
    CPU ranks (the uncalibrated CPU rates)."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        nearest = min((p for p in PROFILES.values() if p.cores == 0),
                      key=lambda p: abs(p.memory_bytes - props.total_memory))
        return replace(nearest, name=props.name, memory_bytes=float(props.total_memory))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return replace(PROFILES["cpu"], memory_bytes=ram / max(1, devices))
