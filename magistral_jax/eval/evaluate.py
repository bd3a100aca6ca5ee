"""Evaluation: math pass@1 averaged over k samples and maj@k; code pass@1 (paper §4); the pass@k
curve of the same samples.

    pass@1 (avg over k) = mean over problems of (correct samples / k)
    maj@k               = mean over problems of [the most frequent final answer is correct]
    pass@j, j = 1, 2, 4, ..., k  the unbiased estimator from each problem's k samples (pass_at_k)
    headroom            = pass@k - pass@1: what turning pass@k into pass@1 (RL) could gain
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Sequence

import numpy as np

from magistral_jax.eval.pass_at_k import pass_at_k_curve
from magistral_jax.generate.loop import GeneratorLoop
from magistral_jax.generate.requests import Request

log = logging.getLogger(__name__)

# Steps between progress checks: each check waits for the step in flight (GeneratorLoop's
# overlap), so it is rare enough to cost nothing measurable.
_STEPS_PER_CHECK = 64


def evaluate(loop: GeneratorLoop, pool, tokenizer, problems: Sequence[dict], *, k: int = 1,
             system_prompt: str | None = None, seed: int = 0, tag: str = "",
             log_every_s: float = 30.0) -> dict:
  """Generates k samples per problem with `loop` (stepped in this thread) and scores them with
  `pool`. Returns summary metrics (pass@1, maj@k, the pass@k curve as `pass_at` {j: value} and
  flat `pass@j` keys, `headroom`) plus per-problem rows (each with its sample count `n` and
  `correct` count, from which any pass@j can be recomputed). Logs a line when it starts and one
  every `log_every_s` while generating (samples done, rate, ETA): a first launch on a GPU spends
  minutes compiling the generator's programs here before its first sample."""
  if not problems:
    raise ValueError("evaluate: no problems")
  for i, p in enumerate(problems):
    prompt = tokenizer.apply_chat_template(p["problem"], system_prompt)
    loop.submit(Request(id=i, prompt_tokens=prompt, group_size=k, metadata=p, seed=seed + i))
  name = f"[eval {tag}]" if tag else "[eval]"
  total = len(problems) * k
  log.info("%s generating %d samples (%d problems x k=%d)", name, total, len(problems), k)
  completions, t0 = [], time.time()
  last = t0
  while True:
    completions += loop.run_until_idle(max_steps=_STEPS_PER_CHECK)
    if loop.idle():
      break
    now = time.time()
    if now - last >= log_every_s:
      last = now
      rate = len(completions) / (now - t0)
      eta = f"{(total - len(completions)) / rate:.0f}s" if rate > 0 else "?"
      log.info("%s %d/%d samples in %.0fs (%.1f/s, ETA %s)", name, len(completions), total,
               now - t0, rate, eta)
  # The length penalty counts the policy's tokens (a tool's results are not its length).
  futures = [(c, pool.submit(c.metadata, c.graded(tokenizer.decode),
                             c.num_policy_tokens, 0)) for c in completions]
  per = collections.defaultdict(list)
  for c, f in futures:
    per[c.request_id].append((c, f.result()))
  rows, pass1, maj, fmt, lengths, counts, calls = [], [], [], [], [], [], []
  for i in range(len(problems)):
    samples = per.get(i, [])
    correct = [float((r.parts.get("correct") or 0) > 0) for _, r in samples]
    pass1.append(float(np.mean(correct)) if correct else 0.0)
    counts.append((len(correct), int(sum(correct))))
    fmt.extend(float((r.parts.get("format") or 0) > 0) for _, r in samples)
    lengths.extend(c.num_policy_tokens for c, _ in samples)
    calls.extend(c.num_tool_results for c, _ in samples)
    answers = [r.info.get("boxed") for _, r in samples if r.info.get("boxed") is not None]
    if answers:
      top = collections.Counter(answers).most_common(1)[0][0]
      maj.append(float(any(r.info.get("boxed") == top and correct[j]
                           for j, (_, r) in enumerate(samples))))
    else:
      maj.append(0.0)
    rows.append({"id": problems[i].get("id", i), "pass1": pass1[-1], "maj": maj[-1],
                 "n": counts[-1][0], "correct": counts[-1][1],
                 "sample": tokenizer.decode(samples[0][0].tokens) if samples else ""})
  # The curve goes up to the fewest samples a problem got (k each, unless some were lost): the
  # estimator needs j <= n for every problem.
  fewest = min(n for n, _ in counts)
  if fewest < k:
    log.warning("%s a problem got %d of its k=%d samples: pass@j up to j=%d only", name, fewest,
                k, fewest)
  curve = pass_at_k_curve(counts)
  out = {"pass@1": float(np.mean(pass1)), f"maj@{k}": float(np.mean(maj)),
         "format_rate": float(np.mean(fmt)) if fmt else 0.0,
         "response_length_mean": float(np.mean(lengths)) if lengths else 0.0,
         # Tool calls per sample (tools.enabled): their results the samples read.
         "tool_calls_mean": float(np.mean(calls)) if calls else 0.0,
         "num_problems": len(problems), "k": k, "pass_at": curve,
         "headroom": curve[max(curve)] - curve[1] if curve else 0.0}
  # pass@1 keeps its meaning above (equal to curve[1], the estimator at j=1 being c / n).
  out.update({f"pass@{j}": v for j, v in curve.items() if j > 1})
  out["rows"] = rows
  return out
