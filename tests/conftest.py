"""Test configuration: every test runs on CPU with 8 simulated devices.

The flag must be set before jax is imported anywhere, hence at the top of conftest.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The second flag: XLA:CPU aborts the process ("Termination timeout ... Exiting to ensure a
# consistent program state") when a simulated device's thread is late to a collective by more
# than a fixed timeout. A 2-core host running a test beside another can starve one device's
# thread that long. A real deadlock now waits 20 min before that abort (or CI's own limit).
for _flag in ("--xla_force_host_platform_device_count=8",
              "--xla_cpu_collective_call_terminate_timeout_seconds=1200"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
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

# `make test` runs the suite in two parts (tools/test.sh): first every test not listed here, on 2
# pytest-xdist workers (most wait on single-threaded XLA compiles, so two at once keep both cores
# busy: 1.5x on tests/model + tests/rl); then these, one at a time. They are either end-to-end
# runs that are compute-bound (beside another test they ran 1.7-2.3x slower, so running them two
# at a time gains nothing), or they bound wall times (heartbeat and sandbox timeouts: a second
# test on the same 2 cores would slow them past their bounds), or they scan the whole host for
# leftovers (a neighbour's sandbox would read as a leak). The `slow` marker is independent: it
# names the long tests (`-m "not slow"` for a quick run); the slow ones not listed here are
# compile-bound and share part 1's workers.
SERIAL = {
    "tests/launch/test_smollm2_rl.py": "compute-bound: SFT and RL on the 135M model",
    "tests/launch/test_tiny_learns.py": "compute-bound end-to-end run",
    "tests/launch/test_colocated.py": "compute-bound end-to-end run",
    "tests/launch/test_rehearsals.py": "compute-bound end-to-end runs",
    "tests/parallel/test_multihost.py": "processes on a 10 s heartbeat timeout",
    "tests/launch/test_multihost_run.py": "processes on a 10 s heartbeat timeout",
    "tests/launch/test_local_cluster.py": "bounded stop times",
    "tests/bench/test_multihost_push.py": "processes on heartbeat timeouts",
    "tests/launch/test_signals.py": "bounded shutdown times",
    "tests/rewards/test_sandbox.py": "1.5 s test timeouts",
    "tests/rewards/test_sandbox_hostile.py": "scans the host for escaped files and processes",
    "tests/rewards/test_sandbox_soak.py": "scans the host for leaked sandboxes",
    "tests/verify/test_pool.py": "task timeouts and leak checks",
    "tests/data/test_code_filter.py": "4 s sandbox timeouts",
}


def pytest_collection_modifyitems(config, items):
  import pytest
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for item in items:
    if os.path.relpath(str(item.path), root) in SERIAL:
      item.add_marker(pytest.mark.serial)
