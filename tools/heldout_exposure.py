"""Re-analyses a learning run recorded before the synthetic task's evaluation bucket (issue #63):
which of its held-out problems it had trained on, and its gain on the ones it never had.

How: magistral_jax/analysis/exposure.py.

  .venv/bin/python tools/heldout_exposure.py docs/results/learn_h100_32batches.tar.gz \\
      --task=synthetic/20/1-3 --sft_pairs=0    # the GPU recipe's cold start is GSM8K's
  (the CPU recipe's cold start: --sft_pairs=96, its 12 SFT steps x 8 of the task's traces)

Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import tarfile
import tempfile

from magistral_jax.analysis.exposure import exposure


def _line(label, g):
  return (f"{label}: {100 * g['gain']:+.1f} [{100 * g['ci_low']:+.1f}, {100 * g['ci_high']:+.1f}]"
          f" ({g['before']:.3f} -> {g['after']:.3f}, {g['n']} problems)")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("archive", help="a learn_runs.tar.gz (or the folder it was unpacked into)")
  p.add_argument("--task", required=True, help="synthetic/OPERAND/STEPS the run trained on")
  p.add_argument("--sft_pairs", type=int, required=True,
                 help="synthetic SFT traces of the cold start (0: a GSM8K cold start)")
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    root = a.archive
    if os.path.isfile(root):
      with tarfile.open(root) as tar:
        tar.extractall(tmp, filter="data")
      root = tmp
    out = exposure(root, a.task, a.sft_pairs, a.seed)
  for run in ("rl", "control"):
    if run in out:
      r = out[run]
      print(f"{run}: {r['trained_on']} of {out['heldout']} held-out problems trained on "
            f"({r['in_sft']} in the SFT traces, {r['in_rl_prompts']} among {r['rl_prompts']} RL "
            "prompts)")
      for name in ("never_trained", "trained", "all"):
        if name in r:
          print("  " + _line(name, r[name]))
  print(json.dumps(out))


if __name__ == "__main__":
  main()
