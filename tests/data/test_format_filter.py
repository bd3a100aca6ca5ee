"""The paper's format filter: proofs, multi-part, multiple choice, verifiable answers."""
import pytest

from magistral_jax.data import format_filter as ff


def _rec(i, problem, answer):
  return {"id": str(i), "problem": problem, "answer": answer, "source": "t", "language": "en"}


@pytest.mark.parametrize("problem,answer", [
    ("Prove that there are infinitely many primes.", ""),
    ("Let $n$ be odd. Show that $n^2 - 1$ is divisible by 8.", "\\blacksquare"),
    ("Find all $x$ with $x^2 = 1$ and justify why no others exist.", "1"),
    ("Compute the sum.", "See proof"),
])
def test_proofs_are_dropped(problem, answer):
  assert ff.check(_rec(0, problem, answer)) == ("proof", None)


def test_show_that_inside_a_word_problem_is_not_a_proof():
  p = "Wilson's report card needs to show that he got 80. What is the mean of 65, 95 and 80?"
  reason, out = ff.check(_rec(0, p, "80"))
  assert reason is None and out["answer"] == "80"


@pytest.mark.parametrize("problem,answer", [
    ("(a) Find $x$ if $2x = 4$. (b) Find $y$ if $3y = 9$.", "2"),
    ("Let $f(x) = x^2$.\na) Compute $f(2)$.\nb) Compute $f(3)$.", "4"),
    ("Consider the sequence. (i) Find the first term. (ii) Find the limit.", "1"),
    ("Part 1: find $x$. Part 2: find $y$.", "3"),
    ("Solve for $x$ and $y$.", "(a) 3 (b) 4"),
])
def test_multi_part_problems_are_dropped(problem, answer):
  assert ff.check(_rec(0, problem, answer)) == ("multi_part", None)


def test_function_arguments_are_not_part_markers():
  reason, _ = ff.check(_rec(0, "If $f(a) = 2$ and $f(b) = 3$ with $(a) (b)$ positive, find $f(a)+f(b)$.", "5"))
  assert reason is None


def test_multiple_choice_lines_become_an_open_question():
  p = ("Find the curve defined by the equation\n\\[r^2 \\cos 2 \\theta = 4.\\](A) Line\n(B) Circle\n"
       "(C) Parabola\n(D) Ellipse\n(E) Hyperbola\n\nEnter the letter of the correct option.")
  reason, out = ff.check(_rec(0, p, "\\text{(E)}"))
  assert reason is None and out["rewritten"] == "multiple_choice"
  assert out["problem"] == "Find the curve defined by the equation\n\\[r^2 \\cos 2 \\theta = 4.\\]"
  assert out["answer"] == "\\text{Hyperbola}"


def test_inline_amc_options_become_an_open_question():
  p = ("What is $\\frac{1}{4} + \\frac{1}{4}$?\n\n$\\textbf{(A)}\\ 1\\qquad\\textbf{(B)}\\ 2\\qquad"
       "\\textbf{(C)}\\ \\frac{1}{2}\\qquad\\textbf{(D)}\\ \\frac{1}{8}$")
  reason, out = ff.check(_rec(0, p, "\\textbf{(C)}"))
  assert reason is None
  assert out["problem"] == "What is $\\frac{1}{4} + \\frac{1}{4}$?"
  assert out["answer"] == "\\frac{1}{2}"


def test_lettered_lines_with_a_bare_letter_answer():
  p = "How many sides has a hexagon?\nA. 5\nB. 6\nC. 8"
  assert ff.check(_rec(0, p, "B"))[1]["answer"] == "6"


@pytest.mark.parametrize("problem,answer", [
    ("Which of the following is prime? (A) 4 (B) 6 (C) 7 (D) 9", "C"),
    ("Select the true statements. (A) $1<2$ (B) $2<1$ (C) $3<4$", "A, C"),
    ("What is $0 \\cdot 5$? (A) 1 (B) 5 (C) none of the above", "(C)"),
    ("Pick the right option.", "A, B"),
])
def test_multiple_choice_that_cannot_be_stated_is_dropped(problem, answer):
  assert ff.check(_rec(0, problem, answer)) == ("multiple_choice_unstatable", None)


def test_multiple_choice_dropped_when_rewriting_is_off():
  p = "How many sides has a hexagon?\nA. 5\nB. 6\nC. 8"
  cfg = ff.FormatFilterConfig(rewrite_multiple_choice=False)
  assert ff.check(_rec(0, p, "B"), cfg) == ("multiple_choice_unstatable", None)


@pytest.mark.parametrize("answer", ["???", "\\text{}", "}{"])
def test_answers_the_verifier_cannot_parse_are_dropped(answer):
  assert ff.check(_rec(0, "Compute it.", answer)) == ("unverifiable_answer", None)


@pytest.mark.parametrize("answer", ["\\frac{14}{3}", "\\left( 3, \\frac{\\pi}{2} \\right)", "p - q",
                                    "x \\in [2,5)", "\\boxed{18}"])
def test_verifiable_answers_are_kept_unchanged(answer):
  rec = _rec(0, "Compute it.", answer)
  assert ff.check(rec) == (None, rec)


def test_report_counts_each_drop_under_one_reason():
  recs = [
      _rec(0, "Prove that (a) holds and (b) holds.", ""),            # proof wins over multi_part
      _rec(1, "(a) Find x. (b) Find y.", "1"),
      _rec(2, "Which of the following? (A) 1 (B) 2", "A"),
      _rec(3, "What is 2+2?", "???"),
      _rec(4, "What is 2+2?", "4"),
      _rec(5, "Hexagon sides?\nA. 5\nB. 6", "B"),
  ]
  report = ff.FilterReport()
  kept = list(ff.format_filter(recs, report=report))
  assert [r["id"] for r in kept] == ["4", "5"]
  assert report.to_json() == {
      "seen": 6, "kept": 2,
      "dropped": {"proof": 1, "multi_part": 1, "multiple_choice_unstatable": 1, "unverifiable_answer": 1},
      "rewritten": {"multiple_choice": 1},
      "dropped_ids": {"proof": ["0"], "multi_part": ["1"], "multiple_choice_unstatable": ["2"],
                      "unverifiable_answer": ["3"]}}


def test_filter_to_dataset_writes_jsonl_report_and_a_loadable_dataset(tmp_path):
  import json
  from magistral_jax.curate import filters
  from magistral_jax.data import jsonl, loader
  src = tmp_path / "raw.jsonl"
  with open(src, "w") as f:
    f.write(json.dumps({"id": "p", "problem": "Prove that 1 < 2.", "answer": "proof"}) + "\n")
    f.write("{broken\n")
    f.write(json.dumps({"id": "k", "problem": "What is 3*4?", "answer": "12"}) + "\n")
    f.write(json.dumps({"id": "mc", "problem": "Sides of a square?\nA. 3\nB. 4", "answer": "B"}) + "\n")
  report = filters.filter_to_dataset([str(src)], kind="math", name="f", data_dir=str(tmp_path / "tfds"),
                                     out_dir=str(tmp_path / "out"), workers=1)
  assert report["kept"] == 2 and report["read"]["skipped"] == {"malformed_json": 1}
  assert report["format"]["dropped"] == {"proof": 1}
  on_disk = json.load(open(tmp_path / "out" / "f.report.json"))
  assert on_disk["format"] == report["format"] and on_disk["dataset"] == report["dataset"]
  probs = loader.ProblemLoader(str(tmp_path / "tfds"), "f", num_epochs=1, shard_index=0,
                               shard_count=1).take(10)
  assert sorted((p["id"], p["answer"]) for p in probs) == [("k", "12"), ("mc", "4")]
  only_proofs = tmp_path / "proofs.jsonl"
  jsonl.write_jsonl(str(only_proofs), [{"problem": "Prove that 1 < 2.", "answer": "proof"}])
  with pytest.raises(jsonl.EmptyDatasetError, match="kept no math rows"):
    filters.filter_to_dataset([str(only_proofs)], kind="math", name="g", data_dir=str(tmp_path / "tfds"),
                              out_dir=str(tmp_path / "out"))
  assert json.load(open(tmp_path / "out" / "g.report.json"))["format"]["dropped"] == {"proof": 1}
