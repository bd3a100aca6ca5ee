"""A run's devices in one process: the trainer's slice and one slice per generator (paper §5's
disaggregated layout), or one slice shared by both (colocated). Many processes lay their devices
out per process (parallel/multihost.py)."""
from __future__ import annotations

from typing import Sequence

import jax

from magistral_jax.parallel.config import DevicesConfig, check_device_layout


def split_devices(trainer_devices: int, generator_devices: Sequence[int],
                  devices: Sequence[jax.Device] | None = None, colocated: bool = False):
  """Disjoint device slices: the first `trainer_devices` for the trainer, then one slice per
  generator. E.g. on 8 devices: split_devices(4, [2, 2]) -> 4 | 2 | 2. Colocated: one generator
  on the trainer's own devices, split_devices(1, ..., colocated=True) -> [d0], [[d0]]."""
  devices = list(jax.devices() if devices is None else devices)
  check_device_layout(trainer_devices, generator_devices, len(devices), colocated)
  trainer = devices[:trainer_devices]
  if colocated:
    return trainer, [trainer]
  gens, i = [], trainer_devices
  for n in generator_devices:
    gens.append(devices[i:i + n])
    i += n
  return trainer, gens


def run_devices(devices: DevicesConfig):
  """split_devices for a run's `devices` section: (trainer devices, generator slices). One
  process's layouts only (run/train.py takes many: parallel.multihost)."""
  if jax.process_count() > 1:
    raise ValueError(f"this launcher runs in one process, but this is a run of "
                     f"{jax.process_count()}; across processes, launch/train.py with "
                     "devices.trainer_processes (README.md \"Many hosts\")")
  return split_devices(devices.trainer, devices.generators, colocated=devices.colocated)
