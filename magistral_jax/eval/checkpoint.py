"""A policy evaluated on held-out sets: what launch/eval.py runs (its docstring: the sets, the
flags and what is written). The evaluation inside an RL run is eval/in_run.py's.

Math: pass@1 averaged over k samples and maj@k; code: pass@1 through the verifier pool (paper §4:
temperature eval.temperature, top-p eval.top_p for math and at most 0.95 for code). The policy
is a checkpoint of the run (`latest` or a step) or the config's initial weights (`init`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import ml_collections as mlc

from magistral_jax import config as config_lib
from magistral_jax.config import RunConfig
from magistral_jax.data.prompts import check_heldout_unseen, heldout_problems, system_prompt_for
from magistral_jax.data.splits import problem_key
from magistral_jax.data.synthetic import set_options
from magistral_jax.data.trained_on import trained_on_for
from magistral_jax.eval.evaluate import evaluate
from magistral_jax.eval.pass_at_k import format_curves
from magistral_jax.generate.loop import GeneratorLoop
from magistral_jax.model import transformer as tfm
from magistral_jax.model.loading import load_policy
from magistral_jax.parallel.layout import run_devices
from magistral_jax.parallel.sharding import make_mesh
from magistral_jax.pipeline.generators import engine_for, shared_prefix_for, tool_turns_for
from magistral_jax.train.checkpointing import RunCheckpointer
from magistral_jax.train.optimizer import make_optimizer
from magistral_jax.train.step import TrainState, state_shardings
from magistral_jax.verify.pool import VerifierPool

log = logging.getLogger("eval")

# The prefill length an evaluation rounds its longest prompt up to, when that is over the
# config's engine.max_prefill_length.
PREFILL_ROUND = 128
# paper §4: top-p 1.0 for math, 0.95 for code (eval.top_p is the math value).
CODE_TOP_P = 0.95


def eval_problems(config: mlc.ConfigDict, name: str, n: int, workdir: str) -> list[dict]:
  """The first n problems of set `name` in a seeded order (train.py's held-out order; code
  problems in Python only)."""
  # The set is its own held-out source: its first n problems, whatever the run trained on.
  overrides = {"data.source": name, "data.heldout": n, "data.heldout_source": ""}
  difficulty = set_options(name)
  if difficulty is not None:   # synthetic/OPERAND/STEPS: the synthetic task at that difficulty
    overrides.update({"data.source": "synthetic",
                      **{f"data.{k}": v for k, v in difficulty.items()}})
  one_set = config_lib.apply_overrides(config, overrides)
  return heldout_problems(one_set, workdir, code_languages=("python",))


def checkpoint_params(run: RunConfig, workdir: str, which: str, model_cfg, init_params):
  """(params on host, step label): from the run's checkpoints (`latest` or a step number) or the
  config's init weights (`init`)."""
  if which == "init":
    if init_params is None:
      log.warning("init.source=random: evaluating randomly initialised weights")
      init_params = tfm.init_params(model_cfg, jax.random.PRNGKey(run.seed))
    return jax.device_get(init_params), "init"
  ck_dir = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(ck_dir):
    raise FileNotFoundError(f"no checkpoints in {ck_dir}; pass --checkpoint=init to evaluate the "
                            "config's initial weights")
  # The restore target: the trainer's TrainState layout, built abstractly (nothing allocated).
  tdev, _ = run_devices(run.devices)
  mesh = make_mesh(dict(run.devices.trainer_mesh), tdev)
  tx = make_optimizer(run.optimizer)
  shapes = tfm.param_shapes(model_cfg)
  abstract = TrainState(jax.ShapeDtypeStruct((), "int32"), shapes, jax.eval_shape(tx.init, shapes),
                        jax.ShapeDtypeStruct((), "int32"))
  sh = state_shardings(model_cfg, tx, mesh, run.sharding.trainer_rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, sh)
  ckpt = RunCheckpointer(ck_dir, async_save=False)
  try:
    if which == "latest":
      got = ckpt.restore_latest(abstract)
      if got is None:
        raise FileNotFoundError(f"no restorable checkpoint in {ck_dir}")
      step, state, _ = got
    else:
      try:
        step = int(which)
      except ValueError:
        raise ValueError(f"--checkpoint={which!r}: expected latest, init or a step number")
      if step not in ckpt.steps():
        raise FileNotFoundError(f"no checkpoint {step} in {ck_dir}; steps: {ckpt.steps()}")
      state, _ = ckpt.restore(step, abstract)
  finally:
    ckpt.close()
  return jax.device_get(state.params), step


def format_table(results: dict, k: int) -> str:
  head = f"{'set':<16}{'kind':<6}{'n':>5}{'pass@1':>9}{f'maj@{k}':>9}{'format':>9}{'len':>8}"
  lines = [head, "-" * len(head)]
  for name, r in results.items():
    maj = f"{r[f'maj@{k}']:.3f}" if r["kind"] == "math" else "-"
    lines.append(f"{name:<16}{r['kind']:<6}{r['num_problems']:>5}{r['pass@1']:>9.3f}{maj:>9}"
                 f"{r['format_rate']:>9.3f}{r['response_length_mean']:>8.1f}")
  return "\n".join(lines)


def fitted_prefill(tok, problems: dict, system_prompt, max_prefill_length: int) -> int:
  """engine.max_prefill_length, or the sets' longest prompt rounded up to PREFILL_ROUND tokens
  when that is longer: a MATH-500 prompt with the paper's system prompt can be ~590 tokens, over
  an RL config's 512-token prefill limit."""
  longest = max(len(tok.apply_chat_template(p["problem"], system_prompt))
                for probs in problems.values() for p in probs)
  if longest <= max_prefill_length:
    return max_prefill_length
  fitted = -(-longest // PREFILL_ROUND) * PREFILL_ROUND
  log.warning("the longest prompt has %d tokens, over engine.max_prefill_length=%d: this "
              "evaluation prefills up to %d", longest, max_prefill_length, fitted)
  return fitted


def evaluate_checkpoint(config: mlc.ConfigDict, workdir: str, checkpoint: str = "latest",
                        sets: str = "", num_problems: int = 0) -> dict:
  """Evaluates the policy `checkpoint` names on `sets` (comma-separated; default the config's
  held-out set), num_problems each (0: data.heldout); prints the table (and the pass@j curves)
  and writes WORKDIR/eval_<step>.json, which it returns."""
  run = config_lib.validate(config, jax.device_count())
  # The default is the set train.py evaluates on, never the training stream (data.source) when
  # the held-out set comes from elsewhere.
  names = [s for s in (sets or run.data.heldout_source or run.data.source).split(",") if s]
  n = num_problems or run.data.heldout
  problems = {s: eval_problems(config, s, n, workdir) for s in names}   # data errors first
  # What the run in `workdir` (and the cold start its weights came from) did train on.
  trained = trained_on_for(run, workdir)
  trained_on = {}
  for s, probs in problems.items():
    if not probs:
      raise ValueError(f"evaluation set {s!r} has no problems")
    # No evaluation may include a problem the config's RL stream trains on (data/prompts.py),
    # nor one the run did train on (data/trained_on.py).
    check_heldout_unseen(config, probs, workdir, what=f"evaluation set {s!r}")
    trained_on[s] = trained.check(map(problem_key, probs), f"evaluation set {s!r}")
  tok, model_cfg, init_params = load_policy(run.model, run.init, run.tokenizer)
  params, step = checkpoint_params(run, workdir, checkpoint, model_cfg, init_params)
  system_prompt = system_prompt_for(run.system_prompt, run.tools.enabled)
  _, gdevs = run_devices(run.devices)
  # The engine fits the sets' longest prompt.
  engine_cfg = dataclasses.replace(run.engine, max_prefill_length=fitted_prefill(
      tok, problems, system_prompt, run.engine.max_prefill_length))
  shared_prefix = shared_prefix_for(engine_cfg, tok, system_prompt)
  k = run.eval.k
  results, out = {}, {"checkpoint": step, "k": k, "temperature": run.eval.temperature,
                      "greedy": run.eval.greedy, "sets": {}}
  engines = {}   # one engine per compiled-in sampling (math's top-p, code's)
  tools = tool_turns_for(run.tools, tok)   # --config.tools.enabled: the policy calls the tool
  with VerifierPool.from_config(run.verifier, run.reward) as pool:
    for name, probs in problems.items():
      kind = "code" if all(p.get("kind") == "code" for p in probs) else "math"
      top_p = run.eval.top_p if kind == "math" else min(run.eval.top_p, CODE_TOP_P)
      sampling = dataclasses.replace(run.eval, top_p=top_p).sampling(tok.eos_id)
      engine = engine_for(model_cfg, gdevs[0], sampling, engine_cfg, engines=engines,
                          mesh_shape=run.devices.generator_mesh,
                          rules=run.sharding.generator_rules)
      t = time.time()
      loop = GeneratorLoop(engine, params, sampling=sampling, seed=run.seed,
                           shared_prefix=shared_prefix, options=engine_cfg,
                           tools=tools() if tools is not None else None)
      res = evaluate(loop, pool, tok, probs, k=k, system_prompt=system_prompt, seed=run.seed,
                     tag=f"{name} @ {step}")
      res["kind"] = kind
      res["heldout_trained_on"] = trained_on[name]
      res["wall_time_s"] = time.time() - t
      results[name] = out["sets"][name] = res
      log.info("[eval %s @ %s] pass@1=%.3f maj@%d=%.3f headroom=%.3f (%d problems, %.1fs)",
               name, step, res["pass@1"], k, res[f"maj@{k}"], res["headroom"],
               res["num_problems"], res["wall_time_s"])
  print(format_table(results, k))
  if k > 1:
    print(f"\npass@j curve (unbiased estimator from k={k} samples per problem) and headroom "
          "(pass@k - pass@1):")
    print(format_curves(results))
  path = os.path.join(workdir, f"eval_{step}.json")
  os.makedirs(workdir, exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  log.info("wrote %s", path)
  return out
