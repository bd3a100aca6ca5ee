"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code") from n samples of a problem, c of them correct:

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i=0}^{k-1} (n - c - i) / (n - i)

the probability that k samples drawn without replacement from the n hold at least one correct
one. Averaged over problems it estimates the chance that k fresh samples solve a problem; pass@1
is then c / n, the pass@1 averaged over samples that evaluate() reports. Pure functions.
"""
from __future__ import annotations

from typing import Mapping, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
  """The estimate for one problem. The product form keeps every factor in [0, 1]: C(n, k)
  itself overflows a float from n ~ 1030 (and is slow as an exact integer long before)."""
  if not 0 <= c <= n:
    raise ValueError(f"pass_at_k: correct count c={c} not in [0, n={n}]")
  if not 1 <= k <= n:
    raise ValueError(f"pass_at_k: k={k} not in [1, n={n}]")
  if n - c < k:   # every k-subset holds a correct sample
    return 1.0
  miss = 1.0
  for i in range(k):
    miss *= (n - c - i) / (n - i)
  return 1.0 - miss


def curve_ks(n: int) -> list[int]:
  """The k of a pass@k curve from n samples: 1, 2, 4, ... up to n, and n itself."""
  if n < 1:
    return []
  ks, k = [], 1
  while k < n:
    ks.append(k)
    k *= 2
  return ks + [n]


def pass_at_k_curve(counts: Sequence[tuple[int, int]], ks: Sequence[int] | None = None
                    ) -> dict[int, float]:
  """{k: mean over problems of pass_at_k(n_i, c_i, k)} for (n_i, c_i) per problem. `ks` defaults
  to curve_ks of the fewest samples any problem has (the estimator needs k <= n_i)."""
  if not counts:
    return {}
  if ks is None:
    ks = curve_ks(min(n for n, _ in counts))
  return {k: sum(pass_at_k(n, c, k) for n, c in counts) / len(counts) for k in ks}


def format_curves(results: Mapping[str, Mapping]) -> str:
  """A table of each set's pass@k curve (evaluate()'s `pass_at`) and headroom: one row a set,
  one column a k (the union of the sets' k; "-" where a set has none)."""
  ks = sorted({int(k) for r in results.values() for k in r["pass_at"]})
  head = f"{'set':<16}" + "".join(f"{f'pass@{k}':>9}" for k in ks) + f"{'headroom':>10}"
  lines = [head, "-" * len(head)]
  for name, r in results.items():
    curve = {int(k): v for k, v in r["pass_at"].items()}
    cells = "".join(f"{curve[k]:>9.3f}" if k in curve else f"{'-':>9}" for k in ks)
    lines.append(f"{name:<16}{cells}{r['headroom']:>10.3f}")
  return "\n".join(lines)
