r"""Evaluation: `python launch/eval.py --config=configs/tiny.py --workdir=runs/tiny`.

Math: pass@1 averaged over k samples and maj@k; code: pass@1 through the verifier pool (paper §4:
temperature 0.7, top-p 1.0 for math and 0.95 for code, k = eval.k). With k > 1 also the pass@j
curve of every set (the unbiased estimator from the k samples, j = 1, 2, 4, ..., k) and its
headroom pass@k - pass@1: `--config.eval.k=16` prints it. The policy is the run's
orbax checkpoint (--checkpoint=latest or a step number; WORKDIR/checkpoints), or the config's
initial weights (--checkpoint=init: init.source/init.path, e.g. an SFT run's params).

Sets (--sets, comma-separated; default: the config's held-out set, data.heldout_source, or
data.source where that is empty):
  synthetic                 the synthetic task's held-out problems (data.heldout of them)
  synthetic/OPERAND/STEPS   the same at one difficulty: operands up to OPERAND, STEPS (or MIN-MAX)
                            steps, e.g. synthetic/99/2-3 (BENCHMARKS.md "A real model learns")
  math500, gsm8k_test, gsm8k_train, humaneval, mbpp_sample20 (gsm8k = gsm8k_test)
                            the shipped public sets, built into data.data_dir (or WORKDIR/data)
  any other name            a math/code dataset already built in data.data_dir
--num_problems caps each set (default data.heldout); the same seeded order as train.py's held-out
split. A set that shares a problem (id or question text) with the config's RL stream
(data.source, less its held-out head) is refused. Prints a table (and the pass@j curves) and
writes WORKDIR/eval_<step>.json (eval_init.json for --checkpoint=init): per set the metrics,
`pass_at` {j: value}, `headroom` and per-problem rows with each problem's sample count `n` and
`correct` count.
"""
from __future__ import annotations

import json
import logging
import os
import time

from magistral_jax import cli  # noqa: F401  (the shared flags; before jax: the CPU device count)

from absl import app, flags  # noqa: E402

_CHECKPOINT = flags.DEFINE_string("checkpoint", "latest",
                                  "latest | a checkpoint step | init (the config's init weights)")
_SETS = flags.DEFINE_string("sets", "", "Comma-separated evaluation sets (default data.source).")
_NUM_PROBLEMS = flags.DEFINE_integer("num_problems", 0, "Problems per set (0: data.heldout).")

log = logging.getLogger("eval")


def eval_problems(config, name: str, n: int, workdir: str) -> list[dict]:
  """The first n problems of set `name` in a seeded order (train.py's held-out order; code
  problems in Python only)."""
  from magistral_jax import config as config_lib
  from magistral_jax.data.prompts import heldout_problems
  from magistral_jax.data.synthetic import set_options
  # The set is its own held-out source: its first n problems, whatever the run trained on.
  overrides = {"data.source": name, "data.heldout": n, "data.heldout_source": ""}
  difficulty = set_options(name)
  if difficulty is not None:   # synthetic/OPERAND/STEPS: the synthetic task at that difficulty
    overrides.update({"data.source": "synthetic",
                      **{f"data.{k}": v for k, v in difficulty.items()}})
  one_set = config_lib.apply_overrides(config, overrides)
  return heldout_problems(one_set, workdir, code_languages=("python",))


def load_policy(config, workdir, which: str, model_cfg, init_params, run):
  """(params on host, step label): from the run's checkpoints or the config's init weights."""
  import jax
  from magistral_jax.model import transformer as tfm
  from magistral_jax.parallel import make_mesh
  from magistral_jax.parallel.layout import run_devices
  from magistral_jax.train.checkpointing import RunCheckpointer
  from magistral_jax.train.optimizer import make_optimizer
  from magistral_jax.train.step import TrainState, state_shardings
  if which == "init":
    if init_params is None:
      log.warning("init.source=random: evaluating randomly initialised weights")
      init_params = tfm.init_params(model_cfg, jax.random.PRNGKey(config.seed))
    return jax.device_get(init_params), "init"
  ck_dir = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(ck_dir):
    raise FileNotFoundError(f"no checkpoints in {ck_dir}; pass --checkpoint=init to evaluate the "
                            "config's initial weights")
  # The restore target: the trainer's TrainState layout, built abstractly (nothing allocated).
  tdev, _ = run_devices(config)
  mesh = make_mesh(dict(config.devices.trainer_mesh), tdev)
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


def main(argv):
  del argv
  config = cli.start_run()
  import jax
  from magistral_jax import config as config_lib
  from magistral_jax.eval.evaluate import evaluate
  from magistral_jax.eval.pass_at_k import format_curves
  from magistral_jax.generate.engine import Engine
  from magistral_jax.generate.loop import GeneratorLoop
  from magistral_jax.generate.config import SamplingConfig
  from magistral_jax.parallel import make_mesh
  from magistral_jax.pipeline.build import build_tokenizer_and_model
  from magistral_jax.parallel.layout import run_devices
  from magistral_jax.pipeline.generators import shared_prefix_for
  from magistral_jax.data.prompts import system_prompt_for
  from magistral_jax.verify import VerifierPool

  run = config_lib.validate(config, jax.device_count())
  workdir = cli.workdir()
  # The default is the set train.py evaluates on, never the training stream (data.source) when
  # the held-out set comes from elsewhere.
  default_sets = config.data.get("heldout_source", "") or config.data.source
  sets = [s for s in (_SETS.value or default_sets).split(",") if s]
  n = _NUM_PROBLEMS.value or config.data.heldout
  from magistral_jax.data.prompts import check_heldout_unseen
  problems = {s: eval_problems(config, s, n, workdir) for s in sets}   # data errors first
  for s, probs in problems.items():
    if not probs:
      raise ValueError(f"evaluation set {s!r} has no problems")
    # No evaluation may include a problem the config's RL stream trains on (data/prompts.py).
    check_heldout_unseen(config, probs, workdir, what=f"evaluation set {s!r}")
  tok, model_cfg, init_params = build_tokenizer_and_model(config)
  params, step = load_policy(config, workdir, _CHECKPOINT.value, model_cfg, init_params, run)
  system_prompt = system_prompt_for(config.system_prompt)
  _, gdevs = run_devices(config)
  gen_mesh = make_mesh(dict(config.devices.generator_mesh), gdevs[0])
  pool = VerifierPool(config.verifier.num_workers, run.reward,
                      task_timeout_s=config.verifier.task_timeout_s,
                      max_tasks_per_worker=config.verifier.max_tasks_per_worker)
  # The engine fits the sets' longest prompt: a MATH-500 prompt with the paper's system prompt can
  # be ~590 tokens, over an RL config's 512-token prefill limit (rounded up to 128 tokens).
  prefill = config.engine.max_prefill_length
  longest = max(len(tok.apply_chat_template(p["problem"], system_prompt))
                for probs in problems.values() for p in probs)
  if longest > prefill:
    fitted = -(-longest // 128) * 128
    log.warning("the longest prompt has %d tokens, over engine.max_prefill_length=%d: this "
                "evaluation prefills up to %d", longest, prefill, fitted)
    prefill = fitted
  k = config.eval.k
  results, out = {}, {"checkpoint": step, "k": k, "temperature": config.eval.temperature,
                      "greedy": config.eval.greedy, "sets": {}}
  try:
    engines = {}
    for name, probs in problems.items():
      kind = "code" if all(p.get("kind") == "code" for p in probs) else "math"
      # paper §4: top-p 1.0 for math, 0.95 for code (config.eval.top_p is the math value).
      top_p = config.eval.top_p if kind == "math" else min(config.eval.top_p, 0.95)
      if top_p not in engines:
        sampling = SamplingConfig(temperature=config.eval.temperature, top_p=top_p,
                                  greedy=config.eval.greedy,
                                  max_new_tokens=config.eval.max_new_tokens, eos_id=tok.eos_id)
        engines[top_p] = Engine(model_cfg, gen_mesh, run.sharding.generator_rules,
                                max_concurrent_decodes=config.engine.max_concurrent_decodes,
                                max_prefill_length=prefill,
                                max_decode_length=config.eval.max_new_tokens, sampling=sampling,
                                attention_windows=config.engine.attention_windows)
      t = time.time()
      loop = GeneratorLoop(engines[top_p], params, seed=config.seed,
                           background_prefill=config.engine.background_prefill,
                           loop_prefill_below=config.engine.loop_prefill_below,
                           shared_prefix=shared_prefix_for(config.engine, tok, system_prompt))
      res = evaluate(loop, pool, tok, probs, k=k, system_prompt=system_prompt,
                     seed=config.seed, tag=f"{name} @ {step}")
      res["kind"] = kind
      res["wall_time_s"] = time.time() - t
      results[name] = res
      log.info("[eval %s @ %s] pass@1=%.3f maj@%d=%.3f headroom=%.3f (%d problems, %.1fs)",
               name, step, res["pass@1"], k, res[f"maj@{k}"], res["headroom"],
               res["num_problems"], res["wall_time_s"])
      out["sets"][name] = res
  finally:
    pool.close()
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


if __name__ == "__main__":
  app.run(main)
