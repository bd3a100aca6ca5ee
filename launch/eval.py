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
`correct` count. The evaluation is magistral_jax/eval/checkpoint.py.
"""
from magistral_jax import cli  # noqa: F401  (the shared flags; before jax: the CPU device count)

from absl import app, flags  # noqa: E402

_CHECKPOINT = flags.DEFINE_string("checkpoint", "latest",
                                  "latest | a checkpoint step | init (the config's init weights)")
_SETS = flags.DEFINE_string("sets", "", "Comma-separated evaluation sets (default data.source).")
_NUM_PROBLEMS = flags.DEFINE_integer("num_problems", 0, "Problems per set (0: data.heldout).")


def main(argv):
  del argv
  config = cli.start_run()
  from magistral_jax.eval.checkpoint import evaluate_checkpoint
  evaluate_checkpoint(config, cli.workdir(), _CHECKPOINT.value, _SETS.value, _NUM_PROBLEMS.value)


if __name__ == "__main__":
  app.run(main)
