r"""Grid sweeps over config fields, one launch/train.py run per point (docs/sweeps.md).

  python launch/sweep.py --config=configs/tiny.py \
      --sweep='rl.eps_high=0.2,0.28;rl.adv_norm=minibatch,group' \
      --workdir_root=runs/sweep [--dry_run] [--extra='--config.num_batches=5']

The cartesian product of the axes (';' separates axes, ',' values) becomes one command line per
point, `--config.X=V` for each axis, with its own workdir under --workdir_root named after the
point (eps_high_0.2-adv_norm_group). Points run one after another (each run uses the whole
machine's devices); a point whose summary.json already has its final evaluation is skipped, and an
interrupted point resumes from its checkpoint like any train.py run. At the end,
WORKDIR_ROOT/sweep.json collects every point's overrides, exit status and summary.json
(magistral_jax/run/sweep.py).

Axis names are checked against the config before anything runs. No jax import: it is a launcher.
"""
from __future__ import annotations

import os
import sys

from absl import app, flags

from magistral_jax.run.sweep import run_sweep

# The repository root: the points run from it, and --config and --script are relative to it.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A plain string, not a config flag: each point's launcher loads the recipe with its overrides.
_CONFIG = flags.DEFINE_string("config", "configs/tiny.py", "Config file (with an optional :arg).")
_SWEEP = flags.DEFINE_string("sweep", "", "Axes: 'a.b=v1,v2;c.d=v3,v4' (cartesian product).")
_ROOT = flags.DEFINE_string("workdir_root", "runs/sweep", "One workdir per point here.")
_SCRIPT = flags.DEFINE_string("script", "launch/train.py", "The launcher each point runs.")
_EXTRA = flags.DEFINE_string("extra", "", "More flags for every point (shell-quoted string).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the command lines, run nothing.")
_SKIP_DONE = flags.DEFINE_bool("skip_done", True, "Skip points whose run finished.")


def main(argv):
  del argv
  failed = run_sweep(_CONFIG.value, _SWEEP.value, _ROOT.value, ROOT, _SCRIPT.value, _EXTRA.value,
                     dry_run=_DRY_RUN.value, skip_done=_SKIP_DONE.value)
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
