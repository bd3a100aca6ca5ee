"""Benchmark: at SmolLM2-135M's shapes, the GRPO train step against a plain cross-entropy step
(process CPU seconds), greedy collation's padding against one sequence per row, and the compiled
GRPO step's peak memory with remat none against full.

  python bench/train_step.py [--rows 1 --row_len 256 --repeats 3]

Last line: one JSON object with every figure.
"""
import common
import jax
import numpy as np

from magistral_jax.model import config as model_config
from magistral_jax.rl import collate as C
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.minibatch import collate_minibatch
from magistral_jax.run.footprint import compiled_memory
from magistral_jax.train import optimizer as O
from magistral_jax.train import step as S
from magistral_jax.train.sft import make_sft_step

SMOLLM2_135M = model_config.SMOLLM2_135M.replace(logits_chunk=256)


def padding_study(rng, n_seq=2048, l_max=1000, spread=5, rows=4):
  lengths = rng.integers(l_max // spread, l_max + 1, n_seq)
  real = int(lengths.sum())
  greedy = C.padding_tokens(lengths, C.first_fit(lengths, l_max), l_max, rows)
  naive_rows = [[i] for i in range(n_seq)]                      # fixed count: one per row
  naive = C.padding_tokens(lengths, naive_rows, l_max, rows)
  dynamic = sum(rows * int(lengths[i:i + rows].max()) - int(lengths[i:i + rows].sum())
                for i in range(0, n_seq, rows))
  return {
      "padding_lengths": f"uniform[{l_max // spread}, {l_max}] x {n_seq}, row_len {l_max}, {rows} rows/microbatch",
      "padding_frac_greedy": greedy / (greedy + real),
      "padding_frac_naive": naive / (naive + real),
      "padding_frac_naive_dynamic": dynamic / (dynamic + real),
      "padding_reduction": 1.0 - greedy / naive,
      "padding_reduction_vs_dynamic": 1.0 - greedy / dynamic,
  }


def make_batch(rng, cfg: GRPOConfig, vocab: int):
  """Completions filling the microbatch: prompts 16-48 tokens, completions with a 5x spread."""
  comps, used = [], 0
  budget = cfg.microbatch_tokens
  for _ in range(200):
    p = rng.integers(1, vocab, rng.integers(16, 33))
    c = rng.integers(1, vocab, rng.integers(cfg.row_len // 10, cfg.row_len // 2))
    n = len(p) + len(c) - 1
    if used + n > budget * 0.85:
      continue
    comps.append(C.Completion(p, c, -np.abs(rng.normal(2.0, 1.0, len(c))), float(rng.normal()),
                              len(comps) // 2))
    used += n
  if len(comps) % 2:
    comps = comps[:-1]
  mb = collate_minibatch(comps, cfg.replace(n_batch=len(comps), n_mini=len(comps), group_size=2))
  return mb.arrays, mb.stats


def main(argv=None):
  args = common.argument_parser(__doc__, rows=2, row_len=256, repeats=3,
                                layers=SMOLLM2_135M.num_layers).parse_args(argv)

  model_cfg = SMOLLM2_135M.replace(num_layers=args.layers)
  rng = np.random.default_rng(0)
  result = {"model": "SmolLM2-135M shapes (random init)", "params": model_cfg.num_params(),
            "devices": f"{jax.device_count()} x {jax.devices()[0].platform}"}
  result.update(padding_study(rng))
  print(f"[padding] greedy {result['padding_frac_greedy']:.3f} vs naive fixed "
        f"{result['padding_frac_naive']:.3f} (dynamic {result['padding_frac_naive_dynamic']:.3f}): "
        f"reduction {result['padding_reduction']:.3f}", flush=True)

  gcfg = GRPOConfig(microbatch_tokens=args.rows * args.row_len, microbatch_rows=args.rows)
  batch, stats = make_batch(rng, gcfg, model_cfg.vocab_size)
  batch = S.shard_batch(batch)
  result["batch"] = f"{stats['sequences']} sequences, {stats['completion_tokens']} completion tokens, " \
                    f"[{args.rows} x {args.row_len}] x {stats['microbatches']} microbatch"
  tx = O.make_optimizer(O.OptimizerConfig(learning_rate=1e-6))

  init_s, state = common.time_once(lambda: S.init_state(model_cfg, tx, jax.random.PRNGKey(0)))
  print(f"[init] {init_s:.1f}s", flush=True)

  compiled = {}
  for name, fn in {"grpo": S.make_grpo_step(model_cfg, gcfg, tx),
                   "ce": make_sft_step(model_cfg, tx)}.items():
    compiled[name], result[f"compile_s_{name}"] = common.compile_timed(
        jax.jit(fn, donate_argnums=0), state, batch)
    print(f"[compile] {name}: {result[f'compile_s_{name}']:.1f}s", flush=True)
    tag = "no_remat" if name == "grpo" else name   # the GRPO step with remat comes below
    result[f"peak_bytes_{tag}"], result[f"temp_bytes_{tag}"] = compiled_memory(compiled[name])

  # On a shared host the wall clock mostly measures the other jobs: the ratio is of CPU seconds.
  carry = common.Carry(state)
  times = common.time_rounds({k: carry.step(fn, batch) for k, fn in compiled.items()},
                             args.repeats)
  state = carry.state
  for r in range(args.repeats):
    print(f"[round {r + 1}] " + ", ".join(
        f"{n}: {t.rounds[r]:.2f}s wall, {t.cpu_rounds[r]:.2f}s cpu" for n, t in times.items()),
        flush=True)
  for name, t in times.items():
    result[f"step_wall_s_{name}"] = t.median
    result[f"step_cpu_s_{name}"] = t.cpu_median
  result["grpo_over_ce_step_time"] = result["step_cpu_s_grpo"] / result["step_cpu_s_ce"]
  result["grpo_over_ce_wall_time"] = result["step_wall_s_grpo"] / result["step_wall_s_ce"]

  grpo_remat, s = common.compile_timed(jax.jit(S.make_grpo_step(
      model_cfg.replace(remat="full"), gcfg, tx), donate_argnums=0), state, batch)
  result["peak_bytes_remat"], result["temp_bytes_remat"] = compiled_memory(grpo_remat)
  print(f"[compile] grpo remat: {s:.1f}s", flush=True)
  result["remat_peak_saving"] = 1.0 - result["peak_bytes_remat"] / result["peak_bytes_no_remat"]
  result["remat_temp_saving"] = 1.0 - result["temp_bytes_remat"] / max(result["temp_bytes_no_remat"], 1)
  common.emit(result)


if __name__ == "__main__":
  main()
