"""Test configuration: every test runs on CPU with 8 simulated devices.

The flag must be set before jax is imported anywhere, hence at the top of conftest.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The second flag: XLA:CPU aborts the process ("Termination timeout ... Exiting to ensure a
# consistent program state") when a simulated device's thread is late to a collective by more
# than a fixed timeout. A 2-core host running a test beside another can starve one device's
# thread that long. A real deadlock is ended sooner, by the per-test timeout below.
for _flag in ("--xla_force_host_platform_device_count=8",
              "--xla_cpu_collective_call_terminate_timeout_seconds=1200"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# One persistent XLA compilation cache per pytest session, shared by the in-process tests and the
# launch/*.py subprocesses some tests start (they inherit the environment). Many tests compile the
# same programs (the tiny model's train step, prefill and decode step on the same meshes) through
# different jit objects, which JAX's in-memory cache cannot share. The directory is fresh for each
# session and removed at its end, so no test sees another run's executables. Set
# MAGISTRAL_TEST_XLA_CACHE=0 to compile everything, or to a directory to keep one. Either way the
# launch scripts never use a user's cache (config.compilation_cache_dir): the variable, set here
# ("" = off), wins over it.
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
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")
# As in the launch scripts (cli.start_run): a program compiled on one slice of the simulated
# devices is loaded, not compiled again, on another (magistral_jax/parallel/cache_key_patch.py).
from magistral_jax.parallel.cache_key_patch import (  # noqa: E402
    share_cpu_executables_across_devices)

share_cpu_executables_across_devices()

# Two tiers. CI's `make test` leaves out the tests marked `long`: the end-to-end learning proofs
# (the tiny default, the real 135M model, the Qwen recipe, the 3-process run with its kills), 4-9
# minutes each on 2 cores, whose learning figures BENCHMARKS.md records from their own commands.
# What they run is in CI in shorter tests: launch/train.py's tiny runs (tests/launch), the 135M
# model's parity and its GSM8K launches, Qwen3's parity and sharded load, the rehearsals, the
# 3-process run with tool calls, a killed trainer or generator process (tests/parallel) and a
# lost and rejoined generator (tests/pipeline). `make test-full` runs every test; run it after a
# change to what a run learns, and before a release.
#
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
    "tests/launch/test_qwen_recipe.py": "compute-bound end-to-end runs (one device)",
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
    "tests/curate/test_code_filter.py": "4 s sandbox timeouts",
}

# Tests marked `own_process` run after the others in a pytest process of their own (tools/test.sh
# part 3): the generation loop and the paged decode step on a mesh with a `data` axis (a page pool
# per data replica). Every part-1 run that held them beside the other tests (6 of 6, 2026-11-28/30)
# ended in a segfault inside XLA:CPU, later and in another test, while it compiled or serialized an
# unrelated program (also with no persistent cache, and with the dense cache write's scatter hints,
# unique_indices / indices_are_sorted, taken out); a run without them passed, and they pass alone or
# with the paged and engine test files in one process. The cause is not isolated (issue #66's note).

# XLA:CPU optimises its LLVM code fully by default. Most tests run their programs a few times on
# tiny shapes, so compiling is most of their work: for them jax_disable_most_optimizations (LLVM
# -O0, no expensive LLVM passes; the HLO passes, and so the programs' semantics, are unchanged) cut
# their CPU time (docs/design_notes.md, "The test suite"). These keep the default, as a
# user's run has it: the compute-bound end-to-end runs, and the real 135M model's parity tests
# (slower or no faster without the optimisation), and the notebooks' tiny run (colocated: as fast
# either way, so it runs as a user's would). The launch/*.py
# subprocesses a test starts follow it through JAX_DISABLE_MOST_OPTIMIZATIONS.
FULL_OPTIMIZATION = {
    "tests/launch/test_smollm2_rl.py", "tests/launch/test_tiny_learns.py",
    "tests/launch/test_qwen_recipe.py", "tests/launch/test_rehearsals.py",
    "tests/launch/test_multihost_run.py", "tests/model/test_smollm2_parity.py",
    "tests/notebooks/test_notebooks.py",
}


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rel(item) -> str:
  return os.path.relpath(str(item.path), _ROOT)


def _set_optimization(full: bool):
  import jax
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0" if full else "1"
  jax.config.update("jax_disable_most_optimizations", not full)


import pytest  # noqa: E402


# pytest.ini's 15 minutes is for the long tests (marked `slow`, or run alone); any other test takes
# well under a minute, so a hang among them is ended sooner, and a few hangs in one run cannot
# spend CI's time limit.
QUICK_TEST_TIMEOUT_S = 480


def pytest_collection_modifyitems(config, items):
  for item in items:
    if _rel(item) in SERIAL:
      item.add_marker(pytest.mark.serial)
    elif not (item.get_closest_marker("slow") or item.get_closest_marker("timeout")):
      item.add_marker(pytest.mark.timeout(QUICK_TEST_TIMEOUT_S))


class _LongestFilesFirst:
  """Part 1 of `make test` (pytest-xdist, --dist loadfile) hands out whole files to its two
  workers in the order the workers collected them (tools/test.sh: --no-loadscope-reorder), each
  worker taking the next file when it is almost done with its own. This order: the files holding
  a `slow` test first, then the others by their number of tests (xdist's own order). By test
  count alone, the few-test files with long end-to-end tests (the notebooks' tiny run, the real
  model's checks) came last, and one worker ran them alone while the other had nothing left.
  A file's tests keep their order (its module fixtures). Only on xdist's workers."""

  @pytest.hookimpl(trylast=True)   # after -m / -k have deselected
  def pytest_collection_modifyitems(self, config, items):
    files = {}
    for item in items:
      files.setdefault(_rel(item), []).append(item)
    slow = {f for f, its in files.items() if any(i.get_closest_marker("slow") for i in its)}
    order = sorted(files, key=lambda f: (f not in slow, -len(files[f])))
    items[:] = [item for f in order for item in files[f]]


# A test that hangs fails in 8 or 15 minutes (above), not at CI's limit: pytest-timeout (thread
# method: it also ends a test blocked in native code, e.g. a device_get waiting on a collective,
# which a signal cannot interrupt) and pytest's `faulthandler_timeout` (every thread's Python
# stack, half a minute before the 15 minutes). A minute before the end this writes
# every thread's native stack (gdb, where the host has it: XLA's threads show who holds a
# rendezvous) and kills the test's child processes, so a launch subprocess does not outlive it.
import threading

_STDERR = []   # the terminal's stderr, as pytest's faulthandler plugin takes it


def pytest_configure(config):
  from _pytest.faulthandler import get_stderr_fileno
  _STDERR.append(os.dup(get_stderr_fileno()))
  if hasattr(config, "workerinput"):   # a pytest-xdist worker
    config.pluginmanager.register(_LongestFilesFirst(), "magistral_longest_files_first")


def _test_timeout(item) -> float:
  marker = item.get_closest_marker("timeout")
  if marker is not None and marker.args:
    return float(marker.args[0])
  return float(item.config.getini("timeout") or 0)


def _report_hang(nodeid: str, after_s: float):
  import subprocess
  import psutil
  out = os.fdopen(os.dup(_STDERR[0]), "w")
  out.write(f"\n===== {nodeid} still running after {after_s:.0f} s: native stacks, then its "
            f"child processes killed =====\n")
  out.flush()
  gdb = shutil.which("gdb")
  if gdb:
    try:
      subprocess.run([gdb, "-batch", "-nx", "-iex", "set auto-load off", "-p", str(os.getpid()),
                      "-ex", "thread apply all bt 25"], stdout=out, stderr=subprocess.STDOUT,
                     stdin=subprocess.DEVNULL, timeout=120)
    except Exception as e:   # no ptrace here, or gdb itself hung: the Python stacks still come
      out.write(f"gdb failed: {e!r}\n")
  for child in psutil.Process().children(recursive=True):
    try:
      out.write(f"killing child {child.pid}: {' '.join(child.cmdline())[:200]}\n")
      child.kill()
    except psutil.Error:
      pass
  # Once more after the stacks, so that the last lines of a cut log still name the test.
  out.write(f"===== the hung test: {nodeid} (ended at {after_s + 60:.0f} s) =====\n")
  out.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  _set_optimization(_rel(item) in FULL_OPTIMIZATION)   # before the test's fixtures compile
  timeout = _test_timeout(item)
  timer = None
  if timeout > 60:
    timer = threading.Timer(timeout - 60, _report_hang, args=(item.nodeid, timeout - 60))
    timer.daemon = True
    timer.start()
  try:
    yield
  finally:
    if timer is not None:
      timer.cancel()
