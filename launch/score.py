r"""Scores a JSONL file of completions offline through the verifier pool.

  python launch/score.py --input=completions.jsonl --output=scored.jsonl [--workers=N]

Input lines (one completion each):
  {"id", "kind": "math", "problem", "answer", "response"}
  {"id", "kind": "code", "problem", "language": "python"|"cpp", "tests": [{"input", "output"}],
   "response"}
  {"id", "kind": "code", "problem", "language": "python", "test_code", "entry_point", "response"}
Optional: "max_tokens" and "response_tokens" (length penalty), "group_seed" (which tests are
drawn; defaults to a hash of the problem, so completions of one problem share their tests).
Each output line is the input plus "reward", "parts" and "error". A malformed line gets an error
and reward 0; it never aborts the file. Output order follows input order.
"""
import json
import os
import sys
import zlib

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from magistral_jax.rewards import RewardConfig  # noqa: E402
from magistral_jax.rewards.reward import empty_parts  # noqa: E402
from magistral_jax.verify import VerifierPool  # noqa: E402

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


def parse_line(raw: bytes, lineno: int):
  """(record, task args) or (record, error message) for one input line."""
  text = raw.decode("utf-8", errors="replace")
  try:
    rec = json.loads(text)
  except json.JSONDecodeError as e:
    return {"line": lineno, "raw": text[:1000]}, f"line {lineno}: invalid JSON: {e}"
  if not isinstance(rec, dict):
    return {"line": lineno, "raw": rec}, f"line {lineno}: expected a JSON object"
  missing = [k for k in ("kind", "problem", "response") if k not in rec]
  if missing:
    return rec, f"line {lineno}: missing field(s) {missing}"
  if not isinstance(rec["response"], str):
    return rec, f"line {lineno}: 'response' must be a string"
  tokens = rec.get("response_tokens")
  if tokens is not None and not isinstance(tokens, int):
    return rec, f"line {lineno}: 'response_tokens' must be an integer"
  task = {k: v for k, v in rec.items() if k not in ("response", "response_tokens", "id")}
  seed = rec.get("group_seed")
  if not isinstance(seed, int):
    seed = zlib.crc32(str(rec["problem"]).encode("utf-8", errors="replace"))
  return rec, (task, rec["response"], tokens, seed)


def score_file(input_path: str, output_path: str, workers: int, cfg: RewardConfig,
               task_timeout_s: float = 120.0, progress: bool = True) -> dict:
  with open(input_path, "rb") as f:
    raw_lines = [l for l in f.read().split(b"\n") if l.strip()]
  rows = [parse_line(l, i + 1) for i, l in enumerate(raw_lines)]
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=len(rows), desc="scoring", unit="completion", file=sys.stderr)
  n_err = 0
  with VerifierPool(workers, cfg, task_timeout_s=task_timeout_s,
                    max_queue=max(64, 4 * workers)) as pool:
    import collections
    window = collections.deque()
    tmp = output_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:

      def drain(block_until: int):
        nonlocal n_err
        while len(window) > block_until:
          rec, fut = window.popleft()
          if isinstance(fut, str):
            res_reward, parts, err = 0.0, empty_parts(), fut
          else:
            r = fut.result()
            res_reward, parts, err = r.reward, r.parts, r.error
          n_err += err is not None
          out.write(json.dumps({**rec, "reward": res_reward, "parts": parts, "error": err},
                               ensure_ascii=False) + "\n")
          if bar:
            bar.update(1)

      for rec, args in rows:
        # Submitting ahead of the writer keeps every worker busy; the pool's queue bounds memory.
        window.append((rec, args if isinstance(args, str) else pool.submit(*args)))
        drain(8 * workers + 64)
      drain(0)
    os.replace(tmp, output_path)
    stats = pool.metrics()
  if bar:
    bar.close()
  stats["lines"] = len(rows)
  stats["lines_with_error"] = n_err
  return stats


def main(argv):
  del argv
  if not FLAGS.input or not FLAGS.output:
    raise app.UsageError("--input and --output are required")
  cfg = RewardConfig(l_max=FLAGS.l_max, l_cache=FLAGS.l_cache, num_tests=FLAGS.num_tests)
  stats = score_file(FLAGS.input, FLAGS.output, FLAGS.workers, cfg, FLAGS.task_timeout_s,
                     FLAGS.progress)
  logging.info("scored %d lines (%d with errors): %s", stats["lines"], stats["lines_with_error"],
               stats)
  print(json.dumps(stats))


if __name__ == "__main__":
  app.run(main)
