r"""Scores a JSONL file of completions offline through the verifier pool.

  python launch/score.py --input=completions.jsonl --output=scored.jsonl [--workers=N]

Input lines (one completion each):
  {"id", "kind": "math", "problem", "answer", "response"}
  {"id", "kind": "code", "problem", "language": "python"|"cpp", "tests": [{"input", "output"}],
   "response"}
  {"id", "kind": "code", "problem", "language": "python", "test_code", "entry_point", "response"}
Optional: "max_tokens" and "response_tokens" (length penalty), "group_seed" (which tests are
drawn; defaults to a hash of the problem, so completions of one problem share their tests).
Each output line is the input plus "reward", "parts" and "error", written as ASCII JSON (escapes
keep it valid UTF-8 even for strings holding lone surrogates), and strict JSON: a NaN or
Infinity that an input line held (Python's json reads them) is written back as the string "NaN",
"Infinity" or "-Infinity" (verify/score_file.py). The stats printed last are strict JSON too. Output order follows input order;
blank lines are skipped. A line that is malformed (bad JSON, a number too long to read, nesting
too deep, missing fields), that cannot be sent to a verifier, or whose record cannot be written
back gets reward 0 and an error that starts "line N:" (N counts every line of the file); it never
aborts the file.
"""
import os

from absl import app, flags, logging

from magistral_jax.rewards.config import RewardConfig
from magistral_jax.verify.score_file import score_file, strict_dumps

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "JSONL file of completions.")
flags.DEFINE_string("output", None, "JSONL file to write scored completions to.")
flags.DEFINE_integer("workers", max(1, (os.cpu_count() or 2) - 1), "Verifier processes.")
flags.DEFINE_float("task_timeout_s", 120.0, "Hard wall-clock limit per completion.")
flags.DEFINE_integer("l_max", RewardConfig.l_max, "Length penalty l_max (tokens), unless the "
                     "line has max_tokens.")
flags.DEFINE_integer("l_cache", RewardConfig.l_cache, "Length penalty l_cache (tokens).")
flags.DEFINE_integer("num_tests", RewardConfig.num_tests, "Tests drawn per code problem.")
flags.DEFINE_boolean("progress", True, "Show a progress bar on stderr.")


def main(argv):
  del argv
  if not FLAGS.input or not FLAGS.output:
    raise app.UsageError("--input and --output are required")
  cfg = RewardConfig(l_max=FLAGS.l_max, l_cache=FLAGS.l_cache, num_tests=FLAGS.num_tests)
  stats = score_file(FLAGS.input, FLAGS.output, FLAGS.workers, cfg, FLAGS.task_timeout_s,
                     FLAGS.progress)
  logging.info("scored %d lines (%d with errors): %s", stats["lines"], stats["lines_with_error"],
               stats)
  print(strict_dumps(stats))


if __name__ == "__main__":
  app.run(main)
