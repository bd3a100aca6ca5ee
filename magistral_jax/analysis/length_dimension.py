"""The "length dimension" experiment (paper §6): perturb the final weights along the top-2
principal directions of the RL checkpoints and score each point by reward and response length.

    w(α1, α2) = w* + α1 c1 + α2 c2,     α_i = m · σ_i  (σ_i: std of the checkpoints along c_i)

Every grid point is scored over the same prompts with the same per-prompt sampling seeds (common
random numbers: differences between points come from the weights, not from the dice), through
the real engine and verifier pool. One Engine + GeneratorLoop serves the whole grid: each point's
weights go in through the loop's in-flight `update_params`, so nothing is recompiled. Finally
reward is regressed on log(mean length), the paper's "reward grows roughly with log(length)".
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence

import numpy as np

from magistral_jax.analysis import pca as pca_lib
from magistral_jax.analysis import workdir as run_lib
from magistral_jax.data import prompts

log = logging.getLogger(__name__)


def fit_reward_log_length(reward: np.ndarray, length: np.ndarray) -> dict:
  """Least squares reward ≈ slope · log(length) + intercept over the grid points.

  Returns slope, intercept, r2 (coefficient of determination) and n. With fewer than two
  distinct lengths the slope is undefined and reported as nan (r2 too)."""
  r = np.asarray(reward, np.float64).reshape(-1)
  l = np.asarray(length, np.float64).reshape(-1)
  if r.shape != l.shape:
    raise ValueError(f"fit_reward_log_length: {r.size} rewards vs {l.size} lengths")
  ok = np.isfinite(r) & np.isfinite(l) & (l > 0)
  r, x = r[ok], np.log(l[ok])
  n = int(r.size)
  if n < 2 or np.ptp(x) == 0:
    return {"slope": float("nan"), "intercept": float(r.mean()) if n else float("nan"),
            "r2": float("nan"), "n": n}
  slope, intercept = np.polyfit(x, r, 1)
  ss_res = float(np.sum((r - (slope * x + intercept)) ** 2))
  ss_tot = float(np.sum((r - r.mean()) ** 2))
  r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
  return {"slope": float(slope), "intercept": float(intercept), "r2": float(r2), "n": n}


def prompt_set(config, num_prompts: int, split: str = "heldout") -> list[dict]:
  """Problems to score on. The synthetic source's 'heldout' split draws from the evaluation
  bucket no training stream draws from (data/synthetic.py; the run's own held-out problems come
  first)."""
  if num_prompts < 1:
    raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
  if config.data.source != "synthetic":
    raise ValueError(f"prompt_set: data.source={config.data.source!r}; build the problem list "
                     "yourself (e.g. with data.loader.ProblemLoader) and pass it as `problems=`")
  from magistral_jax.data import synthetic
  return synthetic.take(num_prompts, config.seed, split, **synthetic.options(config.data))


class GridScorer:
  """Scores parameter vectors by mean reward and mean response length over a fixed prompt set.

  Owns one Engine, one GeneratorLoop (weights switched with update_params) and a VerifierPool;
  close() (or a with-block) releases the pool's processes."""

  def __init__(self, model_cfg, tokenizer, reward_cfg, problems: Sequence[dict], params, *,
               sampling, samples_per_prompt: int = 1, system_prompt: str | None = None,
               max_concurrent_decodes: int = 16, max_prefill_length: int = 64,
               devices=None, num_workers: int = 1, task_timeout_s: float = 60.0, seed: int = 0,
               pool=None):
    import jax
    from magistral_jax.generate.engine import Engine
    from magistral_jax.generate.loop import GeneratorLoop
    from magistral_jax.generate.prefix_cache import common_prefix, useful_shared_prefix
    from magistral_jax.parallel.config import GENERATOR_RULES
    from magistral_jax.parallel.sharding import make_mesh
    from magistral_jax.verify.pool import VerifierPool
    if not problems:
      raise ValueError("GridScorer: no problems to score on")
    if samples_per_prompt < 1:
      raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    self.tokenizer, self.problems = tokenizer, list(problems)
    self.samples_per_prompt, self.seed = int(samples_per_prompt), int(seed)
    self.prompts = [tokenizer.apply_chat_template(p["problem"], system_prompt)
                    for p in self.problems]
    longest = max(len(p) for p in self.prompts)
    if longest > max_prefill_length:
      raise ValueError(f"GridScorer: a prompt has {longest} tokens > max_prefill_length="
                       f"{max_prefill_length}")
    devices = list(devices) if devices is not None else jax.devices()[:1]
    self.engine = Engine(model_cfg, make_mesh({"tensor": -1}, devices), GENERATOR_RULES,
                         max_concurrent_decodes=max_concurrent_decodes,
                         max_prefill_length=max_prefill_length,
                         max_decode_length=sampling.max_new_tokens, sampling=sampling)
    # The prompts' common prefix (the system prompt) is prefilled once per grid point and each
    # prompt's own tokens after it (GeneratorLoop shared_prefix).
    self.loop = GeneratorLoop(self.engine, params, version=0, seed=seed,
                              sampling=self.engine.sampling,
                              shared_prefix=useful_shared_prefix(common_prefix(self.prompts),
                                                                 max_prefill_length))
    # Every program the grid can need (prefill buckets and batch sizes, those continuing the
    # shared prefix, the generate step and the drain's smaller steps) is compiled here, so the
    # grid points only swap weights.
    self.engine.precompile(self.loop.params, existing_prefix=self.loop.shared_prefix_cache())
    self._own_pool = pool is None
    self.pool = pool if pool is not None else VerifierPool(
        num_workers, reward_cfg, task_timeout_s=task_timeout_s)
    self.points = 0

  def score(self, params) -> dict:
    """Generates samples_per_prompt completions per prompt under `params` and scores them.
    Returns reward, length (mean tokens), accuracy, format_rate, logprob (mean log-probability
    of the sampled tokens: how sure these weights are of what they wrote), num_samples,
    seconds."""
    from magistral_jax.generate.requests import Request
    t0 = time.perf_counter()
    self.points += 1
    version = self.points
    self.loop.update_params(params, version)   # swapped in at the next step; no recompile
    for i, tokens in enumerate(self.prompts):
      self.loop.submit(Request(id=i, prompt_tokens=tokens, group_size=self.samples_per_prompt,
                               metadata=self.problems[i], seed=self.seed + i))
    completions = self.loop.run_until_idle()
    expected = len(self.prompts) * self.samples_per_prompt
    if len(completions) != expected:
      raise RuntimeError(f"GridScorer: {len(completions)} completions, expected {expected}")
    stale = [c for c in completions if (np.asarray(c.versions) != version).any()]
    if stale:
      raise RuntimeError(f"GridScorer: {len(stale)} completions were not sampled entirely by "
                         f"grid point {version}'s weights")
    futures = [self.pool.submit(c.metadata, self.tokenizer.decode(c.tokens), len(c.tokens), 0)
               for c in completions]
    results = [f.result() for f in futures]
    lengths = np.asarray([len(c.tokens) for c in completions], np.float64)
    return {
        "reward": float(np.mean([r.reward for r in results])),
        "length": float(lengths.mean()),
        "accuracy": float(np.mean([(r.parts.get("correct") or 0) > 0 for r in results])),
        "format_rate": float(np.mean([(r.parts.get("format") or 0) > 0 for r in results])),
        "logprob": float(np.mean(np.concatenate([c.logprobs for c in completions]))),
        "num_samples": len(results),
        "seconds": time.perf_counter() - t0,
    }

  def close(self):
    if self._own_pool and self.pool is not None:
      self.pool.close()
    self.pool = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def evaluate_grid(scorer: GridScorer, w_star: np.ndarray, components: np.ndarray,
                  alpha1: Sequence[float], alpha2: Sequence[float], like: Any) -> dict:
  """Scores w* + α1 c1 + α2 c2 for every (α1, α2). Returns (len(alpha1), len(alpha2)) arrays
  'reward', 'length', 'accuracy', 'format_rate', 'logprob' (row i = alpha1[i], column j =
  alpha2[j])."""
  keys = ("reward", "length", "accuracy", "format_rate", "logprob")
  out = {k: np.full((len(alpha1), len(alpha2)), np.nan) for k in keys}
  for i, a1 in enumerate(alpha1):
    for j, a2 in enumerate(alpha2):
      w = pca_lib.perturb(w_star, components[:2], (a1, a2))
      res = scorer.score(pca_lib.unflatten_params(w, like))
      for k in keys:
        out[k][i, j] = res[k]
      log.info("grid (%d, %d) α=(%.3g, %.3g): reward=%.4f length=%.1f (%.1fs)", i, j, a1, a2,
               res["reward"], res["length"], res["seconds"])
  return out


@dataclasses.dataclass
class LengthDimensionResult:
  steps: list[int]                 # checkpoint steps used (T of them)
  pca: pca_lib.PCAResult
  multiples1: np.ndarray           # grid in units of σ1 / σ2
  multiples2: np.ndarray
  alpha1: np.ndarray               # the same grid in weight-space units (α_i = m · σ_i)
  alpha2: np.ndarray
  grid: dict                       # 'reward', 'length', 'accuracy', 'format_rate', 'logprob'
  fit: dict                        # reward vs log(length) over the grid points
  num_prompts: int
  samples_per_prompt: int
  compiles: dict                   # engine compile counts after the grid (no growth per point)


def length_dimension(workdir: str, *, multiples1: Sequence[float] = (-2.0, 0.0, 2.0),
                     multiples2: Sequence[float] | None = None, num_prompts: int = 32,
                     samples_per_prompt: int = 4, method: str = "gram",
                     steps: Sequence[int] | None = None, temperature: float | None = None,
                     max_new_tokens: int | None = None, problems: Sequence[dict] | None = None,
                     devices=None, num_workers: int | None = None) -> LengthDimensionResult:
  """The whole analysis on a launch/train.py workdir: load every checkpoint, PCA, score the
  grid around the final checkpoint (the highest step), fit reward against log(length).

  Sampling follows the run's training sampler (config.sampling: temperature, top-p, top-k,
  max_new_tokens, so the length penalty bites where it did in training) unless overridden."""
  from magistral_jax import config as config_lib
  from magistral_jax.generate.config import SamplingConfig
  config = run_lib.read_config(workdir)
  reward_cfg = config_lib.validate(config).reward
  model_cfg, tok = run_lib.model_and_tokenizer(config)
  steps, trees = run_lib.load_all_params(workdir, steps)
  log.info("loaded %d checkpoints of %s: steps %s", len(steps), workdir, steps)
  x = pca_lib.stack_checkpoints(trees)
  pca = pca_lib.top_components(x, k=2, method=method)
  w_star, like = x[-1], trees[-1]
  del trees
  m1 = np.asarray(multiples1, np.float64)
  m2 = m1 if multiples2 is None else np.asarray(multiples2, np.float64)
  alpha1, alpha2 = pca_lib.perturbation_grid(pca, m1, m2)
  sampling = SamplingConfig(
      temperature=config.sampling.temperature if temperature is None else temperature,
      top_p=config.sampling.top_p, top_k=config.sampling.top_k,
      max_new_tokens=max_new_tokens or config.sampling.max_new_tokens, eos_id=tok.eos_id)
  problems = list(problems) if problems is not None else prompt_set(config, num_prompts)
  with GridScorer(model_cfg, tok, reward_cfg, problems, like, sampling=sampling,
                  samples_per_prompt=samples_per_prompt,
                  system_prompt=prompts.system_prompt_for(config.system_prompt),
                  max_concurrent_decodes=config.engine.max_concurrent_decodes,
                  max_prefill_length=config.engine.max_prefill_length, devices=devices,
                  num_workers=num_workers or config.verifier.num_workers,
                  task_timeout_s=config.verifier.task_timeout_s, seed=config.seed) as scorer:
    grid = evaluate_grid(scorer, w_star, pca.components, alpha1, alpha2, like)
    compiles = scorer.engine.compile_counts()
  return LengthDimensionResult(
      steps=steps, pca=pca, multiples1=m1, multiples2=m2, alpha1=alpha1, alpha2=alpha2, grid=grid,
      fit=fit_reward_log_length(grid["reward"], grid["length"]), num_prompts=len(problems),
      samples_per_prompt=samples_per_prompt, compiles=compiles)
