"""Held-out exposure of a learning run recorded before the synthetic task's evaluation bucket
(issue #63): which of its held-out problems it had trained on, and its gain on the ones it never
had (tools/heldout_exposure.py is the command; notebooks/run_report.ipynb uses it on an archive
without a `heldout_trained_on` record).

Before the bucket rule the synthetic streams were synthetic.draws: the held-out set was the first
data.heldout draws of the "heldout" stream, the SFT traces the "sft" stream's, the RL prompts the
"train" stream's. `exposure` regenerates them as the run consumed them (its SFT pairs, and for
each RL run the prompts its batches scored: the sum of `groups_scored` in its metrics.jsonl) and
splits the held-out rows of eval_before/eval_after by exposure, each part with a paired-bootstrap
CI (eval/paired.py).
"""
from __future__ import annotations

import itertools
import json
import os

from magistral_jax.data import synthetic
from magistral_jax.data.splits import normalise_text
from magistral_jax.eval.paired import compare_evals


def _read(root, *path):
  with open(os.path.join(root, *path)) as f:
    return json.load(f)


def _texts(stream, n):
  return {normalise_text(p["problem"]) for p in itertools.islice(stream, n)}


def prompts_scored(run_dir: str) -> int:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return int(sum(r["groups_scored"] for r in rows if "groups_scored" in r))


def exposure(root: str, task: str, sft_pairs: int, seed: int = 0) -> dict:
  opts = synthetic.set_options(task)
  before = _read(root, "rl", "eval_before.json")
  n_held = before["num_problems"]
  held = {p["id"]: normalise_text(p["problem"])
          for p in itertools.islice(synthetic.draws(seed, "heldout", **opts), n_held)}
  sft = _texts((p for p in synthetic.draws(seed, "sft", **opts)), sft_pairs)
  out = {"task": task, "heldout": n_held, "sft_pairs": sft_pairs}
  for run in ("rl", "control"):
    if not os.path.exists(os.path.join(root, run, "eval_after.json")):
      continue
    n_rl = prompts_scored(os.path.join(root, run))
    rl = _texts(synthetic.draws(seed, "train", **opts), n_rl)
    trained = {i for i, t in held.items() if t in sft or t in rl}
    after = _read(root, run, "eval_after.json")
    res = {"rl_prompts": n_rl, "trained_on": len(trained),
           "in_sft": sum(t in sft for t in held.values()),
           "in_rl_prompts": sum(t in rl for t in held.values())}
    for name, keep in (("never_trained", lambda r: r["id"] not in trained),
                       ("trained", lambda r: r["id"] in trained), ("all", lambda r: True)):
      b = [r for r in before["rows"] if keep(r)]
      a = [r for r in after["rows"] if keep(r)]
      if b:
        res[name] = compare_evals(b, a)
    out[run] = res
  return out
