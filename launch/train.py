r"""RL training: `python launch/train.py --config=configs/tiny.py --workdir=runs/tiny`.

Any config field can be overridden (`--config.rl.eps_high=0.3`); a run resumes from the latest
checkpoint in --workdir. The run itself is magistral_jax/run/train.py. Many hosts: one process per
host with `--distributed` and `devices.trainer_processes`; on one machine
`python launch/local_cluster.py --num_processes=3 -- launch/train.py
--config=configs/tiny.py:multihost --workdir=W` (README.md, "Many hosts").
"""
from magistral_jax import cli  # noqa: F401  (before jax: the CPU device count)

import signal

from absl import app


def _on_sigint(signum, frame):
  """Ctrl-C: KeyboardInterrupt as usual, and a flag the batch wait checks in case the exception
  lands in a finalizer, where Python drops it (pipeline/rollouts.py INTERRUPTED)."""
  from magistral_jax.pipeline import rollouts
  rollouts.INTERRUPTED.set()
  raise KeyboardInterrupt


def main(argv):
  del argv
  config = cli.start_run()
  from magistral_jax.run import train
  # After the imports: the handler's own import of the pipeline is then a lookup, never an
  # import of jax inside a signal handler (a Ctrl-C before here is Python's default).
  signal.signal(signal.SIGINT, _on_sigint)
  train.main(config, cli.workdir())


if __name__ == "__main__":
  app.run(main)
