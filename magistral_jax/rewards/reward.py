"""The reward of one completion (paper §2), with every part kept for logging.

    reward = 0                                                  if the format check fails
           = format_reward + correct_reward * correct + language_bonus * same_language
             + length_penalty(|y|, l_max, l_cache)              otherwise
With the paper's values (0.1, 0.9, 0.1) the maximum is 1.1.
"""
from __future__ import annotations

import dataclasses
import hashlib
import traceback
from typing import Any, Sequence

from magistral_jax.rewards import code_check, format as fmt, language, math_check, sandbox
from magistral_jax.rewards.code_result import VerifierFault
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.length import length_penalty

PARTS = ("format", "correct", "language", "length_penalty")
# How the error of a task the verifier could not read starts (a malformed dataset row, not a fault
# of the verifier machinery): the pipeline drops its group either way and names the two apart.
BAD_TASK = "bad task or response"
# How the error of a completion starts when a limit on our side, not the program, stopped it.
VERIFIER_FAULT = "verifier fault"


@dataclasses.dataclass
class RewardResult:
  reward: float
  parts: dict
  error: str | None = None
  info: dict = dataclasses.field(default_factory=dict)   # free-form detail (languages, tests)


def empty_parts(failed_condition: str | None = None) -> dict:
  return dict(dict.fromkeys(PARTS, 0.0), failed_condition=failed_condition)


def reward_metrics(results: Sequence[RewardResult]) -> dict:
  """Means over completions: the reward and each of its parts, accuracy (the answer was correct)
  and format rate (the format check passed); and the largest reward."""
  if not results:
    return {}
  part = lambda p: [r.parts.get(p) or 0.0 for r in results]
  rewards = [r.reward for r in results]
  out = {"reward": float(sum(rewards) / len(rewards)), "reward_max": float(max(rewards))}
  for p in PARTS:
    out[f"reward_{p}"] = float(sum(part(p)) / len(results))
  out["accuracy"] = float(sum(v > 0 for v in part("correct")) / len(results))
  out["format_rate"] = float(sum(v > 0 for v in part("format")) / len(results))
  return out


def failed_result(error: str, failed_condition: str | None = None) -> RewardResult:
  """Reward 0 with an error message: for bad tasks, timeouts and crashed workers."""
  return RewardResult(0.0, empty_parts(failed_condition), error)


def _clean_text(s: Any, name: str) -> str:
  """Valid UTF-8 text from str or bytes (invalid bytes and lone surrogates replaced)."""
  if isinstance(s, (bytes, bytearray)):
    return bytes(s).decode("utf-8", errors="replace")
  if not isinstance(s, str):
    raise TypeError(f"{name} must be a string, got {type(s).__name__}")
  return s.encode("utf-8", errors="replace").decode("utf-8")


def control_coin(group_seed: int, response: str) -> float:
  """A uniform number in [0, 1) fixed by the completion (its group seed and text): the random
  control's coin, the same in every process (no per-process string hash)."""
  digest = hashlib.sha256(f"{group_seed}\0{response}".encode("utf-8", "replace")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def compute_reward(task: dict, response: str, response_tokens: int | None, cfg: RewardConfig,
                   group_seed: int = 0) -> RewardResult:
  """Scores one completion. Never raises: a bad task or internal error gives reward 0 + error.

  `task` follows the score CLI schema: {"kind": "math", "problem", "answer"} or
  {"kind": "code", "problem", "language", "tests" | "test_code"+"entry_point" | "test_list"};
  an optional "max_tokens" overrides cfg.l_max for this task.
  """
  try:
    return _compute(task, response, response_tokens, cfg, group_seed)
  except VerifierFault as e:   # no verdict: the group is dropped, not scored wrong
    return failed_result(f"{VERIFIER_FAULT}: {e}")
  except (ValueError, TypeError, KeyError) as e:
    return failed_result(f"{BAD_TASK}: {type(e).__name__}: {e}")
  except Exception as e:   # keep the pool serving; the trace goes to the log line
    return failed_result(f"internal error: {type(e).__name__}: {e}: "
                         + traceback.format_exc(limit=3)[-500:])


def _compute(task, response, response_tokens, cfg, group_seed) -> RewardResult:
  if not isinstance(task, dict):
    raise TypeError(f"task must be a dict, got {type(task).__name__}")
  kind = task.get("kind")
  if kind not in ("math", "code"):
    raise ValueError(f"task 'kind' must be 'math' or 'code', got {kind!r}")
  response = _clean_text(response, "response")
  problem = _clean_text(task.get("problem", ""), "problem")

  f = fmt.check_format(response, kind)
  if not f.ok:
    return RewardResult(0.0, empty_parts(f.failed_condition))
  parts = empty_parts()
  parts["format"] = cfg.format_reward
  info: dict = {}

  if kind == "math":
    if "answer" not in task:
      raise KeyError("math task needs 'answer'")
    boxed = math_check.last_boxed_answer(f.answer)
    info["boxed"] = boxed[:200]
    correct = math_check.math_equal(boxed, str(task["answer"]), cfg.math_timeout_s)
  else:
    lang, code = code_check.extract_code_block(f.answer, code_check.task_language(task))
    res = code_check.check_code(
        task, lang, code, sandbox=sandbox.default_sandbox(cfg.allow_weak_sandbox),
        num_tests=cfg.num_tests,
        test_timeout_s=cfg.test_timeout_s, memory_mb=cfg.memory_mb,
        compile_timeout_s=cfg.compile_timeout_s, python=cfg.python or code_check.default_python(),
        group_seed=group_seed)
    correct = res.passed
    info["code"] = res.detail
  parts["correct"] = cfg.correct_reward if correct else 0.0
  paid = parts["correct"]
  if cfg.control == "random":
    paid = cfg.correct_reward if control_coin(group_seed, response) < cfg.control_rate else 0.0
    info["control_paid"] = paid

  if cfg.language_bonus:
    same, found = language.language_consistent(problem, f.thoughts, f.answer, tuple(cfg.languages))
    parts["language"] = cfg.language_bonus if same else 0.0
    info["languages"] = found

  if response_tokens is not None:
    l_max = int(task.get("max_tokens") or cfg.l_max)
    l_cache = min(cfg.l_cache, l_max)
    parts["length_penalty"] = length_penalty(int(response_tokens), l_max, l_cache,
                                             cfg.length_penalty_max)
  reward = parts["format"] + paid + parts["language"] + parts["length_penalty"]
  return RewardResult(float(reward), parts, None, info)
