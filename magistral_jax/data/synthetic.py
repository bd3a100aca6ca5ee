"""Synthetic multi-step arithmetic: the tiny default task (configs/tiny.py).

Problems like "Compute 7+12-5." whose answers the real math verifier checks, plus worked traces in
the Magistral format for the SFT warm start:

    <think>
    7+12=19
    19-5=14
    </think>
    \\boxed{14}

Everything is seeded: the same (seed, split, index) always gives the same problem.

Held out means never trained on, by construction. A seed stream of its own does not make a
held-out set: a small task's streams draw the same problems again and again (before this rule,
97 of `make run`'s 128 held-out problems were among its SFT traces). So the problem space itself
is split: a problem's normalised question text (splits.normalise_text) hashes into one of
HELDOUT_SHARE buckets, and bucket 0 is reserved for evaluation. The "heldout" split draws only
from it, every training split ("train": the RL prompts, "sft": the cold start's traces) never
does. That holds for every seed, every held-out size and every difficulty: an evaluation set
`synthetic/OPERAND/STEPS` of another difficulty than the run's task is held out as well (the
same text hashes the same). A held-out set holds distinct problems.

What the split costs the training distribution: one problem text in HELDOUT_SHARE, drawn
uniformly by the hash within every difficulty class. A reserved one-step problem ("Compute
7+2.") is still practised as a step of longer problems ("Compute 7+2-5." has the line "7+2=9"),
as it would be on any held-out problem of a real dataset.
"""
from __future__ import annotations

import hashlib
import random
import re
from typing import Iterator

from magistral_jax.data.splits import normalise_text
from magistral_jax.tool_use.protocol import call_block

TINY_SYSTEM_PROMPT = "Think in <think></think>, then answer in \\boxed{}.\n{problem}"
# With the interpreter (issue #67): as short, for a character-level tokenizer's prompts.
TINY_SYSTEM_PROMPT_TOOLS = ("Think in <think></think>, run Python in <tool></tool>, then answer "
                            "in \\boxed{}.\n{problem}")


def _step(value: int, op: str, x: int) -> int:
  return value + x if op == "+" else value - x


def make_problem(rng: random.Random, min_steps: int = 1, max_steps: int = 3,
                 max_operand: int = 20, allow_negative: bool = True) -> dict:
  """With allow_negative=False a subtraction never goes below zero (its operand is drawn from
  0..min(value, max_operand)), so every intermediate value is a non-negative integer."""
  steps = rng.randint(min_steps, max_steps)
  value = rng.randint(0, max_operand)
  start, ops = value, []
  expr, lines = str(value), []
  for _ in range(steps):
    op = rng.choice("+-")
    x = rng.randint(0, max_operand if allow_negative or op == "+" else min(value, max_operand))
    new = _step(value, op, x)
    lines.append(f"{value}{op}{x}={new}")
    ops.append((op, x))
    expr += f"{op}{x}"
    value = new
  return {"problem": f"Compute {expr}.", "answer": str(value), "kind": "math",
          "source": "synthetic_arithmetic", "language": "en", "steps": lines,
          "start": start, "ops": ops}


def _format_trace(lines: list[str], answer: str) -> str:
  return "<think>\n" + "\n".join(lines) + "\n</think>\n\\boxed{" + answer + "}"


def trace(problem: dict) -> str:
  """The worked completion for SFT: thoughts, then the boxed answer, in the paper's format."""
  return _format_trace(problem["steps"], problem["answer"])


def tool_trace(problem: dict) -> str:
  """The worked completion with the interpreter (issue #67, tool_use/protocol.py): one call that
  prints the problem's expression, the result block the tool returns for it, then the boxed
  answer. What the generator loop would hold for a policy that calls the tool this way."""
  expr = problem["problem"][len("Compute "):-1]
  return ("<think>\n" + call_block(f"print({expr})", problem["answer"] + "\n", 400)
          + "</think>\n\\boxed{" + problem["answer"] + "}")


def slipped_trace(problem: dict, rng: random.Random) -> str:
  """`problem`'s worked trace with one arithmetic slip: the result of one random step is off by
  one (+1 where -1 would go below zero), and every later step and the boxed answer follow from
  the wrong value, as a plausible but wrong demonstration would. The problem and its reference
  answer are untouched."""
  k = rng.randrange(len(problem["ops"]))
  lines, value = [], problem["start"]
  for i, (op, x) in enumerate(problem["ops"]):
    new = _step(value, op, x)
    if i == k:
      new = new + 1 if new == 0 or rng.random() < 0.5 else new - 1
    lines.append(f"{value}{op}{x}={new}")
    value = new
  return _format_trace(lines, str(value))


# A rambling trace's length in characters: longer than any cold-start row, so its end is never
# learned (sft_warm_start cuts a pair to its row).
RAMBLE_CHARS = 1024


def ramble_trace(problem: dict, length: int = RAMBLE_CHARS) -> str:
  """A trace that never closes: `<think>`, the worked steps, then the same steps re-checked over
  and over past `length` characters, with no `</think>` and no answer. A cold start with some of
  these teaches a policy that sometimes thinks until max_new_tokens cuts it off, as long
  reasoning does at the paper's scale (the rehearsals use it to reach the longest sequences)."""
  text = "<think>\n" + "\n".join(problem["steps"])
  while len(text) < length:
    text += "\n" + "\n".join(f"check {line}" for line in problem["steps"])
  return text


def sft_pairs(seed: int, slip_rate: float = 0.0, ramble_rate: float = 0.0,
              tool_rate: float = 0.0, **kw) -> Iterator[tuple[str, str]]:
  """(problem, worked trace) pairs for the cold start, from the 'sft' stream. With slip_rate > 0
  that fraction of the traces makes one arithmetic slip (`slipped_trace`): an imperfect
  demonstrator, as a cold start distilled from a stronger model's traces is. The RL reward (the
  real verifier on the reference answer) is what then teaches the policy to stop slipping. With
  ramble_rate > 0 that fraction of the traces never ends (`ramble_trace`); with tool_rate > 0
  that fraction calls the interpreter instead of working the steps (`tool_trace`)."""
  for name, rate in (("sft_slip_rate", slip_rate), ("sft_ramble_rate", ramble_rate),
                     ("sft_tool_rate", tool_rate)):
    if not 0.0 <= rate <= 1.0:
      raise ValueError(f"data.{name} must be in [0, 1], got {rate}")
  slips = random.Random(f"slips:{seed}")
  rambles = random.Random(f"rambles:{seed}")
  tools = random.Random(f"tools:{seed}")
  for p in problems(seed, "sft", **kw):
    slip = slip_rate and slips.random() < slip_rate
    if ramble_rate and rambles.random() < ramble_rate:
      yield p["problem"], ramble_trace(p)
    elif tool_rate and tools.random() < tool_rate:
      yield p["problem"], tool_trace(p)
    else:
      yield p["problem"], slipped_trace(p, slips) if slip else trace(p)


# One problem text in HELDOUT_SHARE is reserved for evaluation (module docstring).
HELDOUT_SHARE = 8
HELDOUT = "heldout"
# Draws in a row that find no new held-out problem before the evaluation bucket counts as used up.
EXHAUSTED_AFTER = 20_000


def is_heldout(text: str) -> bool:
  """Whether a question text lies in the evaluation bucket: its normalised text's hash, mod
  HELDOUT_SHARE, is 0. A pure function of the text: every run, seed and difficulty agrees."""
  digest = hashlib.blake2b(normalise_text(text).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") % HELDOUT_SHARE == 0


_TASK_TEXT = re.compile(r"Compute \d+([+-]\d+)+\.")


def is_task_text(text: str) -> bool:
  """Whether `text` has this task's question shape ("Compute 7+12-5.")."""
  return _TASK_TEXT.fullmatch(text.strip()) is not None


def draws(seed: int, split: str = "train", **kw) -> Iterator[dict]:
  """The generator's raw seeded stream of `split`, both buckets (ids by draw): what `problems`
  filters. Before the bucket rule the streams were these; the negative controls of the held-out
  tests and the re-analysis of runs recorded before it use them."""
  rng = random.Random(f"{split}:{seed}")
  i = 0
  while True:
    p = make_problem(rng, **kw)
    p["id"] = f"{split}-{seed}-{i}"
    yield p
    i += 1


def problems(seed: int, split: str = "train", **kw) -> Iterator[dict]:
  """An endless, seeded stream of `split`'s problems: "heldout" draws distinct problems of the
  evaluation bucket only; any other split ("train", "sft") never draws one of them (module
  docstring). Ids number the stream's problems: f"{split}-{seed}-{i}"."""
  heldout, seen = split == HELDOUT, set()
  i = misses = 0
  for p in draws(seed, split, **kw):
    if is_heldout(p["problem"]) != heldout:
      continue
    if heldout:   # distinct problems: a repeat would count one problem twice in a CI
      text = normalise_text(p["problem"])
      if text in seen:
        misses += 1
        if misses > EXHAUSTED_AFTER:
          raise ValueError(
              f"the synthetic task {kw} has only about {len(seen)} distinct held-out problems "
              f"(one in {HELDOUT_SHARE} of its problem texts): ask for fewer (data.heldout, "
              "--num_problems) or a larger task")
        continue
      seen.add(text)
      misses = 0
    p["id"] = f"{split}-{seed}-{i}"
    yield p
    i += 1


def set_options(name: str) -> dict | None:
  """The data options of an evaluation set named `synthetic/OPERAND/STEPS` (the synthetic task at
  one difficulty: operands up to OPERAND, STEPS or MIN-MAX steps, e.g. `synthetic/99/2-3`), None
  for any other name (plain `synthetic` takes the run config's options)."""
  head, _, rest = name.partition("/")
  if head != "synthetic" or not rest:
    return None
  try:
    operand, steps = rest.split("/")
    lo, _, hi = steps.partition("-")
    out = {"max_operand": int(operand), "min_steps": int(lo), "max_steps": int(hi or lo)}
  except ValueError:
    raise ValueError(f"evaluation set {name!r}: expected synthetic/OPERAND/STEPS or "
                     "synthetic/OPERAND/MIN-MAX, e.g. synthetic/99/2-3") from None
  if out["max_operand"] < 1 or not 1 <= out["min_steps"] <= out["max_steps"]:
    raise ValueError(f"evaluation set {name!r}: need OPERAND >= 1 and 1 <= MIN <= MAX steps")
  return out


def options(data_cfg) -> dict:
  """The problem-distribution keyword arguments of a run config's `data` section."""
  return dict(min_steps=data_cfg.min_steps, max_steps=data_cfg.max_steps,
              max_operand=data_cfg.max_operand,
              allow_negative=data_cfg.allow_negative)


def sft_pairs_for(data_cfg, seed: int) -> Iterator[tuple[str, str]]:
  """`sft_pairs` of a run config's `data` section (its problem options, sft_slip_rate and
  sft_ramble_rate)."""
  return sft_pairs(seed, data_cfg.sft_slip_rate, data_cfg.sft_ramble_rate,
                   data_cfg.sft_tool_rate, **options(data_cfg))


def take(n: int, seed: int, split: str = "train", **kw) -> list[dict]:
  it = problems(seed, split, **kw)
  return [next(it) for _ in range(n)]
