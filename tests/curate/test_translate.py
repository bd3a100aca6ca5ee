"""Translation of a fraction of the problems, checked with fastText (lid.176)."""
import collections
import re

import pytest

from magistral_jax.curate import translate as T

PROBLEM = "What is the sum of the first ten positive integers? Give the answer as an integer."
# Translations written for this test; the translator below returns the one the prompt asks for.
WRITTEN = {
    "French": "Quelle est la somme des dix premiers entiers positifs ? Donnez la réponse sous forme de nombre entier.",
    "Spanish": "¿Cuál es la suma de los diez primeros enteros positivos? Da la respuesta como un número entero.",
    "Italian": "Qual è la somma dei primi dieci numeri interi positivi? Dai la risposta come numero intero.",
    "German": "Wie groß ist die Summe der ersten zehn positiven ganzen Zahlen? Gib die Antwort als ganze Zahl an.",
    "Chinese (simplified)": "前十个正整数的和是多少？请以整数形式给出答案。",
    "Russian": "Чему равна сумма первых десяти положительных целых чисел? Дайте ответ в виде целого числа.",
}


def phrasebook_translator(prompts):
  out = []
  for p in prompts:
    lang = re.search(r"from English into (.+?)\. ", p).group(1)
    assert p.endswith(PROBLEM)                 # the problem travels in the prompt
    out.append(f'"{WRITTEN[lang]}"')
  return out


def _recs(n):
  return [{"id": f"q{i}", "problem": PROBLEM, "answer": "55", "source": "t", "language": "en"}
          for i in range(n)]


def test_selection_is_a_stable_fraction_spread_over_all_languages():
  cfg = T.TranslationConfig(fraction=0.1, seed=3)
  picks = [T.target_language(f"id{i}", cfg) for i in range(4000)]
  chosen = [p for p in picks if p]
  assert 0.085 < len(chosen) / 4000 < 0.115
  assert set(chosen) == set(cfg.languages)
  assert picks == [T.target_language(f"id{i}", cfg) for i in range(4000)]
  assert picks != [T.target_language(f"id{i}", T.TranslationConfig(seed=4)) for i in range(4000)]


def test_translations_are_checked_kept_and_labelled():
  report = T.TranslationReport()
  cfg = T.TranslationConfig(fraction=1.0, batch_problems=7)
  out = list(T.translate_problems(_recs(60), phrasebook_translator, cfg, report))
  assert len(out) == 60
  assert report.selected == 60 and sum(report.translated.values()) == 60 and not report.rejected
  langs = collections.Counter(r["language"] for r in out)
  assert set(langs) == set(cfg.languages)
  for r in out:
    assert r["answer"] == "55" and r["id"] == f"{r['translated_from']}@{r['language']}"
    assert r["problem"] == WRITTEN[T.LANGUAGE_NAMES[r["language"]]]   # quotes stripped


def test_wrong_language_and_empty_translations_are_rejected_and_the_original_kept():
  replies = iter(["  ", PROBLEM, "<think>hmm</think>" + WRITTEN["German"]])

  def translator(prompts):
    return [next(replies) for _ in prompts]

  cfg = T.TranslationConfig(fraction=1.0, languages=("de",))
  report = T.TranslationReport()
  out = list(T.translate_problems(_recs(3), translator, cfg, report))
  assert [r["language"] for r in out] == ["en", "en", "de"]
  assert out[0]["problem"] == PROBLEM and out[2]["problem"] == WRITTEN["German"]
  assert report.to_json() == {"seen": 3, "selected": 3, "translated": {"de": 1},
                              "rejected": {"empty": 1, "wrong_language": 1}}


def test_keep_original_adds_the_translation_next_to_it():
  cfg = T.TranslationConfig(fraction=1.0, languages=("fr",), keep_original=True)
  out = list(T.translate_problems(_recs(2), phrasebook_translator, cfg))
  assert [r["id"] for r in out] == ["q0", "q0@fr", "q1", "q1@fr"]


def test_non_english_problems_are_not_translated_again():
  rec = dict(_recs(1)[0], language="fr", problem=WRITTEN["French"])
  out = list(T.translate_problems([rec], phrasebook_translator, T.TranslationConfig(fraction=1.0)))
  assert out == [rec]


def test_bad_config_is_a_clear_error():
  with pytest.raises(ValueError, match="not supported"):
    T.TranslationConfig(languages=("xx",))
