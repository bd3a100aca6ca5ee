"""Held out means never trained on, for every shipped recipe: each recipe's streams are drawn as
far as the recipe consumes them (its cold start's traces, its RL prompts with room for dropped
groups) and none holds a problem of its held-out set, or of the synthetic sets launch/eval.py
evaluates on. Negative control: the synthetic streams as they were before the evaluation bucket
(synthetic.draws) fail the same check."""
import itertools
import math
import os

import pytest

from magistral_jax.data import gsm8k_traces, jsonl, synthetic
from magistral_jax.data import tfds_builders as tb
from magistral_jax.data.prompts import heldout_problems, train_prompts
from magistral_jax.data.splits import normalise_text, overlap, problem_key, sft_key
from magistral_jax.eval.checkpoint import eval_problems
from magistral_jax.run.recipes import load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (recipe, argument): every shipped recipe and the variants a user or a test launches.
RECIPES = [
    ("configs/tiny.py", ""), ("configs/tiny.py", "colocated"), ("configs/tiny.py", "multihost"),
    ("configs/tiny.py", "colocated,mode=async"), ("configs/tiny.py", "slip=0.0"),
    ("configs/smollm2.py", ""), ("configs/smollm2.py", "sft"), ("configs/smollm2.py", "ci"),
    ("configs/smollm2.py", "sft,ci"), ("configs/smollm2.py", "gpu,colocated"),
    ("configs/smollm2_learn.py", "sft,colocated"), ("configs/smollm2_learn.py", "colocated"),
    ("configs/smollm2_learn.py", "control,colocated"),
    ("configs/smollm2.py", "sft,gpu,colocated"), ("configs/smollm2_learn.py", "gpu,colocated"),
    ("configs/smollm2_learn.py", "control,gpu,colocated"),
    ("configs/qwen.py", ""), ("configs/qwen.py", "tiny"),
    ("configs/medium.py", ""), ("configs/medium.py", "rehearsal"),
    ("configs/small.py", ""), ("configs/small.py", "rehearsal"),
]
# RL prompts a run draws, per prompt its batches train on: zero-advantage groups are dropped and
# replaced (make run drew ~2,090 prompts for 1,600 trained), and n_async runs ahead.
DRAW_SLACK = 4
# The synthetic evaluation sets of bench/learn.py's headroom table (launch/eval.py --sets).
EVAL_SETS = ("synthetic/20/1-3", "synthetic/99/2-3", "synthetic/999/2-4")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("recipes")
  tb.build_shipped(str(d), ["gsm8k_train", "gsm8k_test", "math500"])
  return str(d)


def _recipe(path, arg, data_dir):
  c = load_recipe(f"{path}:{arg}" if arg else path, ROOT)
  c.data.data_dir = data_dir
  return c


def _stages(c):
  """(num_batches, n_batch, group_size, n_async) of each stage (the run's when unstaged)."""
  out = []
  for s in (c.stages or [{"num_batches": c.num_batches, "overrides": {}}]):
    o = dict(s.get("overrides", {}))
    out.append((s.get("num_batches", c.num_batches), o.get("rl.n_batch", c.rl.n_batch),
                o.get("rl.group_size", c.rl.group_size),
                o.get("pipeline.n_async", c.pipeline.n_async)))
  return out


def _rl_draws(c) -> int:
  n = 0
  for batches, n_batch, group, n_async in _stages(c):
    n += DRAW_SLACK * batches * n_batch // group + (n_async or 2 * n_batch) // group
  return n


def trained_keys(c, data_dir):
  """The keys of everything recipe `c` trains on: its in-run cold start's traces, its SFT
  datasets (launch/sft.py) and its RL prompts, as far as it draws them."""
  keys = []
  if c.sft.num_steps > 0 and c.data.source == "synthetic":   # the cold start's traces
    n = c.sft.num_steps * c.sft.batch_size
    keys += [("", normalise_text(q)) for q, _ in
             itertools.islice(synthetic.sft_pairs(c.seed, 0.0, 0.0, **synthetic.options(c.data)),
                              n)]
  names = c.data.source.split(",")
  if gsm8k_traces.NAME in names:   # launch/sft.py's GSM8K traces: every row
    gsm8k_traces.build_trace_dataset(data_dir, heldout=heldout_problems(c, data_dir))
    keys += [sft_key(r) for _, r in jsonl.iter_rows(
        os.path.join(data_dir, f"{gsm8k_traces.NAME}.jsonl"), jsonl.ReadReport())]
    return keys
  heldout = heldout_problems(c, data_dir)
  stream = train_prompts(c, heldout, None, data_dir)
  n = _rl_draws(c)
  if c.data.source != "synthetic":   # epochs of a finite set: two of them hold every problem
    n = min(n, 2 * sum(stream.loader._fingerprint["datasets"].values()))
  keys += [problem_key(p) for p in itertools.islice(stream, n)]
  return keys


def evaluated_keys(c, data_dir):
  """The recipe's held-out set, and for a synthetic task the headroom table's sets too."""
  keys = [problem_key(p) for p in heldout_problems(c, data_dir)]
  if c.data.source == "synthetic" or c.data.heldout_source == "":
    for name in EVAL_SETS:
      keys += [problem_key(p) for p in eval_problems(c, name, 64, data_dir)]
  return keys


@pytest.mark.parametrize("path,arg", RECIPES, ids=[f"{p[8:-3]}:{a}" for p, a in RECIPES])
def test_no_recipe_trains_on_a_problem_it_evaluates_on(path, arg, data_dir):
  c = _recipe(path, arg, data_dir)
  trained = trained_keys(c, data_dir)
  assert trained, "the recipe draws nothing to train on"
  same_id, same_text = overlap(evaluated_keys(c, data_dir), trained)
  assert not same_id and not same_text, (same_id[:5], same_text[:5])


def test_negative_control_the_streams_before_the_bucket_rule_fail(data_dir, monkeypatch):
  """synthetic.draws is what the streams were: make run's held-out problems sit in its traces."""
  c = _recipe("configs/tiny.py", "", data_dir)
  held = [problem_key(p) for p in synthetic.take(c.data.heldout, c.seed, "heldout",
                                                   **synthetic.options(c.data))]
  old_held = [problem_key(p) for p in itertools.islice(
      synthetic.draws(c.seed, "heldout", **synthetic.options(c.data)), c.data.heldout)]
  monkeypatch.setattr(synthetic, "problems", synthetic.draws)   # the old streams
  trained = trained_keys(c, data_dir)
  _, same_text = overlap(old_held, trained)
  assert len(same_text) > c.data.heldout // 2   # 97 of 128 at the time of issue #63
  assert overlap(held, trained)[1]   # even the new held-out set meets the old streams


def test_the_draw_bound_covers_what_a_run_draws():
  """make run trains 200 batches of 8 prompts and drew ~2,090 (dropped groups replaced)."""
  c = load_recipe("configs/tiny.py", ROOT)
  assert _rl_draws(c) >= 2090
  assert math.isclose(_rl_draws(c), DRAW_SLACK * 200 * 8 + 16)
