"""Test configuration: every test runs on CPU with 8 simulated devices.

The flag must be set before jax is imported anywhere, hence at the top of conftest.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# One persistent XLA compilation cache per pytest session, shared by the in-process tests and the
# launch/*.py subprocesses some tests start (they inherit the environment). Many tests compile the
# same programs (the tiny model's train step, prefill and decode step on the same meshes) through
# different jit objects, which JAX's in-memory cache cannot share. The directory is fresh for each
# session and removed at its end, so no test sees another run's executables. Set
# MAGISTRAL_TEST_XLA_CACHE=0 to compile everything (as before), or to a directory to keep one.
import atexit
import shutil
import tempfile

_cache = os.environ.get("MAGISTRAL_TEST_XLA_CACHE", "")
if _cache != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    if not _cache:
        _cache = tempfile.mkdtemp(prefix="magistral_jax_xla_cache_")
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
