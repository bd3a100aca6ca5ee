"""One persistent-cache entry per program, whatever CPU devices it runs on.

JAX's persistent compilation cache keys an executable by its program and its compile options. On
GPU, JAX leaves the device assignment out of the key and binds a loaded executable to the devices
of the call. On CPU it keeps the assignment in, so the same program on another slice of devices
compiles again: a run's second generator (the first one's engine programs, on its own devices), or
a test on devices 2-3 after one on 0-1. An XLA:CPU executable does not depend on which devices run
it (they are bound when it is loaded, as on GPU), so on CPU this gives the assignment the treatment
JAX gives it on GPU. tests/test_compilation_cache.py checks that a program loaded for another
slice, in another order, runs there and gives the same result, collectives included.

What an XLA:CPU executable does depend on is the process layout. Once jax.distributed is up,
its collectives run over gloo, even between two devices of one process, and a program's devices
may sit in several processes. So a CPU key also holds the number of processes and
the process of each device it runs on: a 4-device program compiled in one process and the same
program over two processes (2 + 2 devices) have different executables, and loading one for the
other ended a 3-process run at its first collective ("gloo ... Received data size doesn't match
expected size") after a one-process run had filled the same cache.

Other platforms keep JAX's keys. This patches two functions of jax._src.cache_key; on a JAX whose
functions differ it does nothing and says so (the cache stays correct, only less shared).
"""
import functools
import hashlib
import inspect
import logging
import threading

import numpy as np

_log = logging.getLogger(__name__)
_keying_cpu = threading.local()   # set while cache_key.get keys a CPU program, in that thread


def share_cpu_executables_across_devices() -> bool:
  """Installs the CPU keying (idempotent; before or after the backends start). Returns whether it
  is in effect."""
  from jax._src import cache_key
  get = getattr(cache_key, "get", None)
  if getattr(get, "_magistral_cpu_shared", False):
    return True
  hash_options = getattr(cache_key, "_hash_serialized_compile_options", None)
  if (get is None or hash_options is None or "strip_device_assignment" not in
      inspect.signature(hash_options).parameters):
    _log.warning("this JAX's cache_key.get/_hash_serialized_compile_options are not the ones "
                 "cache_key_patch.py wraps: persistent-cache entries stay per device assignment "
                 "on CPU")
    return False

  @functools.wraps(get)
  def keyed(module, devices, compile_options, backend, *args, **kwargs):
    cpu = getattr(backend, "platform", None) == "cpu"
    _keying_cpu.on = cpu
    try:
      key = get(module, devices, compile_options, backend, *args, **kwargs)
    finally:
      _keying_cpu.on = False
    return with_process_layout(key, process_layout(devices)) if cpu else key

  @functools.wraps(hash_options)
  def hashed(hash_obj, compile_options_obj, strip_device_assignment=False):
    strip = strip_device_assignment or getattr(_keying_cpu, "on", False)
    return hash_options(hash_obj, compile_options_obj, strip_device_assignment=strip)

  keyed._magistral_cpu_shared = True
  cache_key.get = keyed
  cache_key._hash_serialized_compile_options = hashed
  return True


def process_layout(devices) -> tuple[int, tuple[int, ...]]:
  """(processes in the run, the process of each device a program runs on, in order)."""
  import jax
  return jax.process_count(), tuple(int(d.process_index) for d in np.ravel(devices))


def with_process_layout(key: str, layout: tuple[int, tuple[int, ...]]) -> str:
  """A cache key (`name-digest`) whose digest also covers the process layout; one process's keys
  are left as JAX makes them."""
  if layout[0] == 1:
    return key
  name, digest = key.rsplit("-", 1)
  return f"{name}-{hashlib.sha256(f'{digest} {layout}'.encode()).hexdigest()}"
