"""The device sections of the run config: `devices` (which devices train and which generate)
and `sharding` (the logical axis -> mesh axes tables). Plain frozen dataclasses and tables,
importing nothing of the implementation (magistral_jax/config.py assembles them)."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Parameters: 'vocab', 'embed', 'heads', 'kv_heads', 'head_dim', 'mlp',
# 'layers', 'norm'. Activations: the 'act_*' names and the KV cache's 'cache_*' names.
TRAINER_RULES: tuple[tuple[str, Any], ...] = (
    ("act_batch", ("data", "fsdp")),
    ("act_length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("cache_batch", ("data", "fsdp")),
    ("cache_length", None),
    # A paged KV cache's pages: one pool per data replica, split as the slots are (cache_batch).
    ("cache_pages", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
)
# Generators hold a full copy of the weights per tensor-parallel group (no FSDP gathers inside
# the decode loop, which is memory-bandwidth bound): only 'tensor' shards parameters.
GENERATOR_RULES: tuple[tuple[str, Any], ...] = tuple(
    (name, None) if name == "embed" else (name, axes) for name, axes in TRAINER_RULES)
DEFAULT_RULES = TRAINER_RULES
# Every logical axis name the model code uses (the default table names each once).
LOGICAL_AXES = tuple(name for name, _ in TRAINER_RULES)


def rules_from_config(rules: Sequence[Sequence[Any]], where: str = "sharding rules"
                      ) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
  """A rules table from its config form: (logical axis, mesh axes) pairs, the mesh axes one name,
  a sequence of names (sharded over their product) or None (replicated). Lists (a config read
  back from JSON) become tuples, so the table is hashable (ShardingCtx is a module attribute).
  A logical axis left out is replicated. Errors name `where` (e.g. "sharding.trainer_rules")
  and the offending entry: an unknown logical or mesh axis, a logical axis given twice, a mesh
  axis repeated within one rule, anything but a pair."""
  out, seen = [], set()
  for i, rule in enumerate(rules):
    if not isinstance(rule, (list, tuple)) or len(rule) != 2:
      raise ValueError(f"{where}[{i}] = {rule!r}: expected a (logical axis, mesh axes) pair")
    name, axes = rule
    if name not in LOGICAL_AXES:
      raise ValueError(f"{where}[{i}]: unknown logical axis {name!r}; known: {list(LOGICAL_AXES)}")
    if name in seen:
      raise ValueError(f"{where}[{i}]: logical axis {name!r} has a rule already")
    seen.add(name)
    if isinstance(axes, (list, tuple)):
      axes = tuple(axes)
    elif axes is not None and not isinstance(axes, str):
      raise ValueError(f"{where}[{i}]: {name!r} -> {axes!r}; expected a mesh axis, a sequence "
                       "of mesh axes or None")
    names = () if axes is None else (axes,) if isinstance(axes, str) else axes
    for a in names:
      if a not in MESH_AXES:
        raise ValueError(f"{where}[{i}]: {name!r} -> unknown mesh axis {a!r}; mesh axes: "
                         f"{list(MESH_AXES)} (or None: replicated)")
    if len(set(names)) != len(names):
      raise ValueError(f"{where}[{i}]: {name!r} -> {axes!r} repeats a mesh axis")
    out.append((name, axes))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  """The run config's `sharding` section: the trainer's and the generators' rules tables, checked
  and normalised by rules_from_config."""
  trainer_rules: tuple[tuple[str, Any], ...] = TRAINER_RULES
  generator_rules: tuple[tuple[str, Any], ...] = GENERATOR_RULES

  def __post_init__(self):
    for f in ("trainer_rules", "generator_rules"):
      object.__setattr__(self, f, rules_from_config(getattr(self, f), f"sharding.{f}"))


@dataclasses.dataclass(frozen=True)
class DevicesConfig:
  """The run config's `devices` section: the device layout (paper §5).

  Disaggregated (the paper's layout): the first `trainer` devices train, then one slice of
  `generators[i]` devices per generator. colocated=True: one generator on the trainer's own
  devices (`generators` unused), generation and training taking turns (pipeline.mode sync) or
  generating one batch ahead while a batch trains (async). trainer_processes > 0: a run of many
  JAX processes (one per host, parallel/multihost.py): processes 0..trainer_processes-1 train on
  all their devices, every other process serves one generator on its own devices (`trainer` and
  `generators` unused): on all of them, or on its first `generator_process_devices` (> 0).
  The meshes are over ('data', 'fsdp', 'tensor'); -1 takes what is left."""
  trainer: int = 4
  generators: tuple[int, ...] = (2, 2)
  trainer_mesh: dict = dataclasses.field(default_factory=lambda: {"fsdp": -1})
  generator_mesh: dict = dataclasses.field(default_factory=lambda: {"tensor": -1})
  colocated: bool = False
  trainer_processes: int = 0
  generator_process_devices: int = 0

  def __post_init__(self):
    object.__setattr__(self, "generators", tuple(int(n) for n in self.generators))
    for f in ("trainer_mesh", "generator_mesh"):
      mesh = dict(getattr(self, f))
      unknown = sorted(set(mesh) - set(MESH_AXES))
      if unknown:
        raise ValueError(f"devices.{f}: unknown mesh axes {unknown}; valid axes: {MESH_AXES}")
      object.__setattr__(self, f, mesh)
    if self.trainer_processes < 0 or self.generator_process_devices < 0:
      raise ValueError(f"devices.trainer_processes={self.trainer_processes} and "
                       f"devices.generator_process_devices={self.generator_process_devices} "
                       "must be >= 0")

  def check_layout(self, num_devices: int) -> None:
    """Raises a clear error unless the trainer and every generator get >= 1 of `num_devices`
    (colocated: the trainer's devices alone, which the generator shares). A run of many
    processes (trainer_processes > 0) lays its devices out per process (parallel/multihost.py)."""
    if self.trainer_processes:
      return
    check_device_layout(self.trainer, self.generators, num_devices, self.colocated)


COLOCATED_HINT = ("for fewer devices use the colocated layout, where the trainer and one "
                  "generator share the trainer's devices and take turns: --config=<recipe>:"
                  "colocated (configs/tiny.py, configs/smollm2.py) or "
                  "--config.devices.colocated=True --config.devices.trainer=<devices>")


def check_device_layout(trainer_devices: int, generator_devices: Sequence[int],
                        num_devices: int, colocated: bool = False) -> None:
  """Raises a clear error unless the trainer and every generator get >= 1 of `num_devices`
  (colocated: the trainer's devices alone, which the generator shares)."""
  import jax   # the platform, for the message
  generator_devices = tuple(generator_devices)
  if colocated:
    if not 1 <= trainer_devices <= num_devices:
      raise ValueError(f"devices: colocated on trainer={trainer_devices} devices, but this "
                       f"machine has {num_devices} ({jax.default_backend()})")
    return
  if trainer_devices < 1 or not generator_devices or any(n < 1 for n in generator_devices):
    raise ValueError(f"device layout needs >= 1 device for the trainer and each generator, got "
                     f"trainer={trainer_devices}, generators={generator_devices}")
  need = trainer_devices + sum(generator_devices)
  if need > num_devices:
    raise ValueError(f"devices: trainer={trainer_devices} + generators={generator_devices} = "
                     f"{need} devices, but this machine has {num_devices} "
                     f"({jax.default_backend()}); {COLOCATED_HINT}")

