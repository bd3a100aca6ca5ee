"""What every launcher shares: the --config / --workdir / --distributed flags and the start of a
run (logging, jax.distributed, the parsed config).

Import this module before jax: on a CPU host it asks for 8 simulated devices (the trainer and
generator slices of the default layout), a flag that only the host platform reads, so it is
harmless on GPU/TPU hosts.
"""
from __future__ import annotations

import logging
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Run configuration file.")
WORKDIR = flags.DEFINE_string("workdir", "runs/tiny", "Checkpoints, metrics and summary.json.")
DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "One of many processes: jax.distributed.initialize() first, from the "
    "MAGISTRAL_* variables launch/local_cluster.py sets, else JAX's cluster auto-detection.")


def workdir() -> str:
  return os.path.abspath(WORKDIR.value)


def compilation_cache(config) -> str | None:
  """Turns on JAX's persistent compilation cache at config.compilation_cache_dir (with its size
  limit), unless JAX_COMPILATION_CACHE_DIR is set: then JAX already follows that variable ("" =
  off). Returns the directory in use (None: off)."""
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return os.environ["JAX_COMPILATION_CACHE_DIR"] or None
  path = config.get("compilation_cache_dir", "")
  if not path:
    return None
  import jax
  path = os.path.abspath(os.path.expanduser(path))
  max_gb = float(config.get("compilation_cache_max_gb", 0.0))
  if max_gb < 0:
    raise ValueError(f"compilation_cache_max_gb must be >= 0 (0 = no limit), got {max_gb}")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_compilation_cache_max_size", int(max_gb * 2**30) if max_gb else -1)
  return path


def start_run():
  """Logging to stdout (libraries quieted), optional jax.distributed initialisation, JAX's
  persistent compilation cache (compilation_cache), and the parsed --config."""
  logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                      format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
  for noisy in ("absl", "jax._src.xla_bridge", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  if DISTRIBUTED.value:   # one process per host: see parallel/multihost.py
    from magistral_jax.parallel import multihost
    multihost.initialize()
  config = CONFIG.value
  cache = compilation_cache(config)
  if cache:   # a second generator's programs load from the first one's entries
    # (parallel/cache_key_patch.py)
    from magistral_jax.parallel.cache_key_patch import share_cpu_executables_across_devices
    share_cpu_executables_across_devices()
  logging.getLogger("cli").info("XLA compilation cache: %s", cache or "off")
  return config
