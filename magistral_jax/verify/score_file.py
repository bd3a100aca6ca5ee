"""Scoring a JSONL file of completions through the verifier pool, line by line, losing none
(launch/score.py is its command line; the line schema and the error contract are there).

What we write is strict JSON (RFC 8259): Python's json reads `NaN`, `Infinity` and `-Infinity`
in an input line and would echo them back, but they are not JSON and strict readers (jq, most
other languages) reject the whole line. So every non-finite float we write, in a record or in the
stats, is written as the string "NaN", "Infinity" or "-Infinity" (`finite_json`): the value stays
readable and no reader fails on it.
"""
import collections
import json
import math
import os
import sys
import zlib

from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import empty_parts
from magistral_jax.verify.pool import VerifierPool


def parse_line(raw: bytes, lineno: int):
  """(record, task args) or (record, error message) for one input line."""
  text = raw.decode("utf-8", errors="replace")
  bad = {"line": lineno, "raw": text[:1000]}
  try:
    rec = json.loads(text)
  except json.JSONDecodeError as e:
    return bad, f"line {lineno}: invalid JSON: {e}"
  except RecursionError:
    return bad, f"line {lineno}: invalid JSON: nested too deeply to parse"
  except ValueError as e:   # an integer past Python's int<->str digit limit
    return bad, f"line {lineno}: invalid JSON value: {e}"
  except Exception as e:   # whatever else the decoder raises must not end the run either
    return bad, f"line {lineno}: unreadable JSON: {type(e).__name__}: {e}"
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


_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def finite_json(value):
  """`value` with every non-finite float (in dicts, lists and tuples, at any depth) replaced by
  the string "NaN", "Infinity" or "-Infinity", so that json.dumps(..., allow_nan=False) can
  write it. Containers with nothing to replace are returned as they are (no copy)."""
  if isinstance(value, float):
    return value if math.isfinite(value) else _NON_FINITE.get(value, "NaN")
  if isinstance(value, dict):
    new = {k: finite_json(v) for k, v in value.items()}
    return value if all(new[k] is v for k, v in value.items()) else new
  if isinstance(value, (list, tuple)):
    new = [finite_json(v) for v in value]
    return value if all(a is b for a, b in zip(new, value)) else new
  return value


def strict_dumps(value) -> str:
  """ASCII, strict JSON (no NaN or Infinity literals): see the module docstring."""
  return json.dumps(finite_json(value), allow_nan=False)


def output_line(lineno: int, rec, reward: float, parts: dict, error: str | None):
  """(text, error) of one input line's output: the record plus its score, as ASCII JSON.

  ASCII escapes keep the file valid UTF-8 whatever the strings hold (a lone surrogate from a
  `\\ud800` escape cannot be encoded as UTF-8); non-finite floats are written as strings
  (`strict_dumps`), so every line is strict JSON. A record that cannot be serialised at all
  (nested past the encoder's depth, say) is replaced by its line number and id, with reward 0
  and an error, so one line never costs the others their output.
  """
  try:
    return strict_dumps({**rec, "reward": reward, "parts": parts, "error": error}) + "\n", error
  except Exception as e:
    msg = f"line {lineno}: the record could not be written back ({type(e).__name__}: {e})"
    if error:
      msg += f"; scoring error: {error}"
    out = {"line": lineno, "reward": 0.0, "parts": empty_parts(), "error": msg}
    rid = rec.get("id") if isinstance(rec, dict) else None
    if isinstance(rid, (str, int)) and not isinstance(rid, bool):
      out["id"] = rid
    return strict_dumps(out) + "\n", msg


def score_file(input_path: str, output_path: str, workers: int, cfg: RewardConfig,
               task_timeout_s: float = 120.0, progress: bool = True) -> dict:
  with open(input_path, "rb") as f:
    # Line numbers count blank lines too, so an error's line number is the file's.
    lines = [(i + 1, l) for i, l in enumerate(f.read().split(b"\n")) if l.strip()]
  rows = [(n, *parse_line(l, n)) for n, l in lines]
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=len(rows), desc="scoring", unit="completion", file=sys.stderr)
  n_err = 0
  with VerifierPool(workers, cfg, task_timeout_s=task_timeout_s,
                    max_queue=max(64, 4 * workers)) as pool:
    window = collections.deque()
    tmp = output_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:

      def drain(block_until: int):
        nonlocal n_err
        while len(window) > block_until:
          lineno, rec, fut = window.popleft()
          if isinstance(fut, str):
            res_reward, parts, err = 0.0, empty_parts(), fut
          else:
            try:
              r = fut.result()
              res_reward, parts, err = r.reward, r.parts, r.error
            except Exception as e:   # the pool resolves every future; this is a last resort
              res_reward, parts, err = 0.0, empty_parts(), f"{type(e).__name__}: {e}"
            if err is not None:   # the pool's errors (timeouts, unsendable tasks) lack the line
              err = f"line {lineno}: {err}"
          line, err = output_line(lineno, rec, res_reward, parts, err)
          n_err += err is not None
          out.write(line)
          if bar:
            bar.update(1)

      # Submitting ahead of the writer keeps every worker busy; the pool's queue bounds memory.
      for lineno, rec, args in rows:
        if not isinstance(args, str):
          try:
            args = pool.submit(*args)
          except Exception as e:
            args = f"line {lineno}: could not submit the task: {type(e).__name__}: {e}"
        window.append((lineno, rec, args))
        drain(8 * workers + 64)
      drain(0)
    os.replace(tmp, output_path)
    stats = pool.metrics()
  if bar:
    bar.close()
  stats["lines"] = len(rows)
  stats["lines_with_error"] = n_err
  return stats
