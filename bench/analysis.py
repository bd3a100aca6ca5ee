"""Benchmark: analysis/ (paper §6). pca: the top-2 components of T checkpoints of W weights by
the Gram matrix and by Lanczos against numpy's thin SVD (all three must agree). grid: scoring
perturbation-grid points with one Engine (update_params) against a fresh Engine per point.

  python bench/analysis.py [--repeats 3]

Last line: one JSON object with every number.
"""
import common

common.use_cpu_devices()

import numpy as np  # noqa: E402

from magistral_jax.analysis import pca as P  # noqa: E402


def bench_pca(t: int, w: int, repeats: int) -> dict:
  rng = np.random.default_rng(0)
  # A trajectory: steady drift + a slower second motion + per-checkpoint noise.
  steps = np.arange(t, dtype=np.float64)
  d = rng.standard_normal((2, w)).astype(np.float32)
  x = (rng.standard_normal(w).astype(np.float32)[None]
       + np.outer(steps, d[0]).astype(np.float32) * 1e-2
       + np.outer(np.sin(steps), d[1]).astype(np.float32) * 5e-3
       + rng.standard_normal((t, w)).astype(np.float32) * 1e-3)

  def svd():
    xc = x.astype(np.float64) - x.mean(axis=0, dtype=np.float64)
    _, s, vt = np.linalg.svd(xc, full_matrices=False)
    return s[:2] ** 2, vt[:2]
  # numpy results: nothing for jax to wait for.
  times = common.time_rounds({"gram": lambda: P.top_components(x, 2, "gram"),
                              "lanczos": lambda: P.top_components(x, 2, "lanczos"), "svd": svd},
                             repeats, block=False)
  t_gram, t_lz, t_svd = (times[k].median for k in ("gram", "lanczos", "svd"))
  g, lz, (lam, vt) = (times[k].result for k in ("gram", "lanczos", "svd"))
  return {
      "T": t, "W": w, "gram_s": t_gram, "lanczos_s": t_lz, "svd_baseline_s": t_svd,
      "gram_speedup_vs_svd": t_svd / t_gram, "lanczos_speedup_vs_svd": t_svd / t_lz,
      "max_rel_eig_err_gram": float(np.max(np.abs(g.eigenvalues - lam) / lam)),
      "max_rel_eig_err_lanczos": float(np.max(np.abs(lz.eigenvalues - lam) / lam)),
      "min_abs_cos_gram": float(np.min(np.abs(np.sum(g.components * vt, axis=1)))),
      "min_abs_cos_lanczos": float(np.min(np.abs(np.sum(lz.components * vt, axis=1)))),
  }


def bench_grid(points: int, prompts: int, samples: int, max_new_tokens: int) -> dict:
  import jax
  from magistral_jax import config as config_lib
  from magistral_jax.analysis import length_dimension as ld
  from magistral_jax.analysis import workdir as R
  from magistral_jax.data.prompts import system_prompt_for
  from magistral_jax.generate.config import SamplingConfig
  from magistral_jax.model import named
  from magistral_jax.run.recipes import load_recipe
  from magistral_jax.verify.pool import VerifierPool
  config = load_recipe("configs/tiny.py", common.ROOT)
  model_cfg, tok = R.model_and_tokenizer(config)
  params = jax.tree.map(np.asarray, named.random_params(model_cfg))
  flat = P.flatten_params(params)
  direction = np.random.default_rng(1).standard_normal(flat.size)
  direction /= np.linalg.norm(direction)
  grid = [P.unflatten_params(P.perturb(flat, direction[None], [a]), params)
          for a in np.linspace(-5, 5, points)]
  problems = ld.prompt_set(config, prompts)
  kw = dict(sampling=SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens,
                                    eos_id=tok.eos_id),
            samples_per_prompt=samples, system_prompt=system_prompt_for(config.system_prompt),
            max_concurrent_decodes=8, max_prefill_length=64)
  reward_cfg = config_lib.validate(config).reward
  with VerifierPool(1, reward_cfg) as pool:
    def lengths(points):   # one GridScorer (one Engine) for all of `points`
      with ld.GridScorer(model_cfg, tok, reward_cfg, problems, points[0], pool=pool, **kw) as s:
        return [s.score(p)["length"] for p in points]
    ours = lambda: lengths(grid)
    baseline = lambda: [lengths([p])[0] for p in grid]   # a fresh Engine per point
    baseline()   # warm the verifier processes and Python-side caches for both
    t_ours, l_ours = common.time_once(ours, block=False)
    t_base, l_base = common.time_once(baseline, block=False)
  assert l_ours == l_base, (l_ours, l_base)   # same seeds, same weights: same samples
  return {"points": points, "prompts": prompts, "samples_per_prompt": samples,
          "max_new_tokens": max_new_tokens, "update_params_s": t_ours,
          "engine_per_point_baseline_s": t_base, "grid_speedup": t_base / t_ours}


def main():
  args = common.argument_parser(__doc__, T=16, W="814208,4000000", repeats=2,
                                points=5).parse_args()
  res = {"pca": []}
  for w in args.W.split(","):
    res["pca"].append(bench_pca(args.T, int(w), args.repeats))
    common.emit(res["pca"][-1])
  res["grid"] = bench_grid(args.points, prompts=4, samples=2, max_new_tokens=32)
  common.emit(res["grid"])
  common.emit(res)


if __name__ == "__main__":
  main()
