"""One persistent-cache entry per program, whatever CPU devices it runs on.

JAX's persistent compilation cache keys an executable by its program and its compile options. On
GPU, JAX leaves the device assignment out of the key and binds a loaded executable to the devices
of the call. On CPU it keeps the assignment in, so the same program on another slice of devices
compiles again: a run's second generator (the first one's engine programs, on its own devices), or
a test on devices 2-3 after one on 0-1. An XLA:CPU executable does not depend on which devices run
it (they are bound when it is loaded, as on GPU), so on CPU this gives the assignment the treatment
JAX gives it on GPU. tests/test_compilation_cache.py checks that a program loaded for another
slice, in another order, runs there and gives the same result, collectives included.

Other platforms keep JAX's keys. This patches two functions of jax._src.cache_key; on a JAX whose
functions differ it does nothing and says so (the cache stays correct, only less shared).
"""
import functools
import inspect
import logging
import threading

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
    _keying_cpu.on = getattr(backend, "platform", None) == "cpu"
    try:
      return get(module, devices, compile_options, backend, *args, **kwargs)
    finally:
      _keying_cpu.on = False

  @functools.wraps(hash_options)
  def hashed(hash_obj, compile_options_obj, strip_device_assignment=False):
    strip = strip_device_assignment or getattr(_keying_cpu, "on", False)
    return hash_options(hash_obj, compile_options_obj, strip_device_assignment=strip)

  keyed._magistral_cpu_shared = True
  cache_key.get = keyed
  cache_key._hash_serialized_compile_options = hashed
  return True
