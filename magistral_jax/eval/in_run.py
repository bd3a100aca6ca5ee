"""The held-out evaluation of an RL run: before training, every `eval.every` batches, and after
(paper §4: pass@1 averaged over k samples, maj@k). The leader writes each one to
WORKDIR/eval_<tag>.json, with each problem's sample and correct counts (the paired comparison of
two checkpoints, eval/paired.py), and a line of WORKDIR/heldout_curve.jsonl (the learning
curve)."""
from __future__ import annotations

import json
import logging
import os
import time

from magistral_jax.config import RunConfig
from magistral_jax.eval.evaluate import evaluate
from magistral_jax.generate.loop import GeneratorLoop
from magistral_jax.pipeline.generators import engine_for, tool_turns_for

log = logging.getLogger(__name__)

CURVE_KEYS = ("pass@1", "format_rate", "response_length_mean", "headroom", "num_problems")


def eval_loop_factory(run: RunConfig, model_cfg, devices, tok, shared_prefix, engines=None):
  """params -> a GeneratorLoop with the evaluation's sampling, on `devices`. Its engine is the
  generators' on those devices where they match (`engines`, pipeline.generators.engine_for: same
  lengths and compiled-in sampling; the evaluation's temperature is an input), so evaluating
  compiles nothing the run has not."""
  sampling = run.eval.sampling(tok.eos_id)
  engine = engine_for(model_cfg, devices, sampling, run.engine, engines=engines,
                      mesh_shape=run.devices.generator_mesh, rules=run.sharding.generator_rules)
  tools = tool_turns_for(run.tools, tok)   # evaluated as trained: with the tool, or without
  return lambda params: GeneratorLoop(engine, params, sampling=sampling, seed=run.seed,
                                      shared_prefix=shared_prefix, options=run.engine,
                                      tools=tools() if tools is not None else None)


def run_eval(loop_factory, pool, tok, problems, run: RunConfig, system_prompt, params,
             tag: str) -> dict:
  """Held-out pass@1, maj@k, format rate and length of `params` on `problems`, logged."""
  loop = loop_factory(params)
  t = time.time()
  k = run.eval.k
  res = evaluate(loop, pool, tok, problems, k=k, system_prompt=system_prompt, seed=run.seed,
                 tag=tag)
  log.info("[eval %s] pass@1=%.3f maj@%d=%.3f format=%.3f len=%.1f (%d problems, %.1fs)", tag,
           res["pass@1"], k, res[f"maj@{k}"], res["format_rate"], res["response_length_mean"],
           res["num_problems"], time.time() - t)
  return res


def write_eval(workdir: str, tag: str, batch: int, res: dict, k: int) -> None:
  """WORKDIR/eval_<tag>.json (the whole result, per-problem rows included) and a line of
  WORKDIR/heldout_curve.jsonl (batch, pass@1, format rate, length)."""
  with open(os.path.join(workdir, f"eval_{tag}.json"), "w") as f:
    json.dump({"tag": tag, "batch": batch, "k": k, **res}, f)
  with open(os.path.join(workdir, "heldout_curve.jsonl"), "a") as f:
    f.write(json.dumps({"tag": tag, "batch": batch, **{c: res[c] for c in CURVE_KEYS}}) + "\n")
