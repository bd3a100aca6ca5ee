"""Translating a fraction of the problems, for the language-consistency reward (paper §2, §3).

The paper translates 10% of its (English) problems into French, Spanish, Italian, German,
Chinese and Russian, so that the +0.1 language reward has non-English tasks to act on. Here:
  - which problems: a hash of (seed, id) below `fraction`, so the choice is stable across runs
    and independent of order; the target language is another hash of the same pair;
  - how: a language model through the generator, with a translation prompt (`PROMPT`) sent
    without the Magistral system prompt;
  - check: fastText lid.176 (the classifier the reward uses, on the same LaTeX/code-stripped
    text) must say the translation is in the target language; otherwise it is rejected and
    counted, and the problem stays in English;
  - the answer is kept (numbers and formulas do not change), `language` becomes the target.

Translating is injected: translate_fn(prompts) -> texts (one per prompt).
`generator_translate_fn` is the real one.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import re
from typing import Callable, Iterable, Mapping, Sequence

log = logging.getLogger(__name__)

LANGUAGE_NAMES = {"fr": "French", "es": "Spanish", "it": "Italian", "de": "German",
                  "zh": "Chinese (simplified)", "ru": "Russian"}

PROMPT = (
    "Translate the math problem below from English into {language}. Translate only the words: "
    "copy every LaTeX expression, formula, number and code fragment exactly as it is. Reply with "
    "the translated problem and nothing else.\n\n{problem}")

TranslateFn = Callable[[list], list]


@dataclasses.dataclass(frozen=True)
class TranslationConfig:
  fraction: float = 0.1
  languages: tuple = ("fr", "es", "it", "de", "zh", "ru")
  seed: int = 0
  keep_original: bool = False    # True: add the translation next to the English problem
  batch_problems: int = 64

  def __post_init__(self):
    if not 0.0 <= self.fraction <= 1.0:
      raise ValueError(f"fraction must be in [0, 1], got {self.fraction}")
    unknown = [l for l in self.languages if l not in LANGUAGE_NAMES]
    if unknown or not self.languages:
      raise ValueError(f"languages {unknown or '()'} not supported; choose from {sorted(LANGUAGE_NAMES)}")


def _unit(seed: int, key: str, salt: str) -> float:
  h = hashlib.sha256(f"{seed}\0{salt}\0{key}".encode()).digest()
  return int.from_bytes(h[:8], "big") / 2 ** 64


def target_language(rec_id: str, config: TranslationConfig) -> str | None:
  """The language this problem is translated into, or None if it is not selected."""
  if _unit(config.seed, rec_id, "select") >= config.fraction:
    return None
  return config.languages[int(_unit(config.seed, rec_id, "language") * len(config.languages))]


def translation_prompt(problem: str, lang: str) -> str:
  return PROMPT.format(language=LANGUAGE_NAMES[lang], problem=problem)


def clean_translation(text: str) -> str:
  """Drops a reasoning block and wrapping fences/quotes a chat model may add."""
  text = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL)
  text = text.strip()
  m = re.fullmatch(r"```[a-z]*\n(.*?)\n?```", text, flags=re.DOTALL)
  if m:
    text = m.group(1).strip()
  if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'«":
    text = text[1:-1].strip()
  return text


def check_language(text: str, lang: str) -> str | None:
  """None if fastText finds `lang`, else the reason it does not ('empty' or the language found)."""
  from magistral_jax.rewards.language import detect_language
  if not text.strip():
    return "empty"
  found = detect_language(text)
  if found == lang:
    return None
  return f"found:{found}"


@dataclasses.dataclass
class TranslationReport:
  seen: int = 0
  selected: int = 0
  translated: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def to_json(self) -> dict:
    return {"seen": self.seen, "selected": self.selected, "translated": dict(self.translated),
            "rejected": dict(self.rejected)}


def _batches(it, n):
  batch = []
  for x in it:
    batch.append(x)
    if len(batch) == n:
      yield batch
      batch = []
  if batch:
    yield batch


def translate_problems(recs: Iterable[Mapping], translate_fn: TranslateFn,
                       config: TranslationConfig = TranslationConfig(),
                       report: TranslationReport | None = None):
  """Yields every math record, the selected ones translated (see the module docstring)."""
  report = report if report is not None else TranslationReport()
  for batch in _batches(recs, config.batch_problems):
    report.seen += len(batch)
    chosen = [(i, target_language(r["id"], config)) for i, r in enumerate(batch)]
    chosen = [(i, l) for i, l in chosen if l is not None and batch[i].get("language", "en") == "en"]
    report.selected += len(chosen)
    texts = translate_fn([translation_prompt(batch[i]["problem"], l) for i, l in chosen]) if chosen else []
    if len(texts) != len(chosen):
      raise ValueError(f"translate_fn returned {len(texts)} texts for {len(chosen)} prompts")
    translated = {}
    for (i, lang), raw in zip(chosen, texts):
      text = clean_translation(raw)
      why = check_language(text, lang)
      if why is None:
        report.translated[lang] += 1
        translated[i] = {**batch[i], "id": f"{batch[i]['id']}@{lang}", "problem": text,
                         "language": lang, "translated_from": batch[i]["id"]}
      else:
        report.rejected[why if why == "empty" else "wrong_language"] += 1
        log.info("translation of %s into %s rejected (%s): %r", batch[i]["id"], lang, why, text[:120])
    for i, r in enumerate(batch):
      if i in translated:
        if config.keep_original:
          yield dict(r)
        yield translated[i]
      else:
        yield dict(r)


def generator_translate_fn(loop, tokenizer, *, max_new_tokens: int | None = None) -> TranslateFn:
  """Translations from a `generate.loop.GeneratorLoop` (one sample per prompt, run in the
  calling thread). The prompt is a plain user turn: no Magistral system prompt."""
  import itertools
  from magistral_jax.generate.requests import Request
  counter = itertools.count()

  def translate(prompts: Sequence[str]) -> list:
    base = next(counter) * 1_000_000
    for i, p in enumerate(prompts):
      loop.submit(Request(id=base + i, prompt_tokens=tokenizer.apply_chat_template(p, system_prompt=None),
                          group_size=1, max_new_tokens=max_new_tokens))
    out = [None] * len(prompts)
    for c in loop.run_until_idle():
      out[c.request_id - base] = tokenizer.decode(c.tokens)
    if any(o is None for o in out):
      raise RuntimeError("generator returned fewer translations than requested")
    return out
  return translate
