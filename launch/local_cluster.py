r"""N processes of one multi-controller JAX run on this machine (CI, and a try before a cluster).

  python launch/local_cluster.py --num_processes=3 [--devices_per_process=2] [--grace_s=60] \
      [--log_dir=DIR] [--restart_processes=2,3] -- launch/train.py --config=configs/tiny.py:multihost --workdir=W

Everything after `--` is a Python script and its arguments, run with this interpreter from the
current directory, N times, each with `--distributed` and the MAGISTRAL_* variables that
parallel/multihost.py reads; every line a process prints comes out here as `[p<i>] <line>`, and a
failed process stops the rest. magistral_jax/parallel/local_cluster.py says what each process
gets, and how the run is supervised and ends. No jax import: it is a launcher.
"""
from __future__ import annotations

import sys

from absl import app, flags

from magistral_jax.parallel.local_cluster import run_cluster

_NUM = flags.DEFINE_integer("num_processes", 2, "How many processes.", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices_per_process", 1,
                                "Simulated host-platform devices per process.", lower_bound=1)
_GRACE = flags.DEFINE_float("grace_s", 60.0, "After a process fails, seconds the others get to "
                            "exit on their own before SIGTERM.", lower_bound=0.0)
_RESTART = flags.DEFINE_list("restart_processes", [], "Process ids to relaunch when they die "
                             "(generator processes; a run takes them back).")
_MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 3, "Relaunches per process at most.",
                                     lower_bound=0)
_ONE_THREAD = flags.DEFINE_bool("one_cpu_thread", True, "One XLA:CPU thread per process (the "
                                "processes share this machine's cores).")
# --log_dir (DIR/process_<i>.log gets each process's raw output) is absl.logging's own flag,
# defined when absl.app is imported; nothing here logs through absl, so it writes no other file.


def main(argv):
  command = argv[1:]
  if not command:
    raise app.UsageError("no command: put a Python script and its arguments after `--`, e.g. "
                         "`-- launch/train.py --config=configs/tiny.py:multihost`")
  sys.exit(run_cluster(command, _NUM.value, _DEVICES.value, _GRACE.value,
                       flags.FLAGS.log_dir or None, one_cpu_thread=_ONE_THREAD.value,
                       restart={int(p) for p in _RESTART.value},
                       max_restarts=_MAX_RESTARTS.value))


if __name__ == "__main__":
  app.run(main)
