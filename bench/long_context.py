"""Benchmark: peak memory (the compiled program's, so dense is measured where it could not run)
and time of a tiny model's train step (one packed row of T tokens) and T-token prefill, blockwise
attention against the dense O(T^2) baseline; timed where the peak fits --run_budget_gib.

  python bench/long_context.py [--lengths ...] [--impls dense,blockwise]

Last line, one JSON object: peak_mem_ratio_32k (train step and prefill), max_tokens_in_budget,
max_tokens_in_budget_dense, the host.
"""
import common
import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.model import transformer as T
from magistral_jax.model.config import ModelConfig
from magistral_jax.run.footprint import compiled_memory

GIB = 2 ** 30


def packed_row(t: int, segments: int):
  """tokens, positions, segment ids [1, t]: `segments` equal sequences, positions restarting."""
  seg = np.minimum(np.arange(t) * segments // t, segments - 1) + 1
  starts = np.searchsorted(seg, seg)
  pos = np.arange(t) - starts
  tokens = (np.arange(t) * 7919) % 251
  return tuple(jnp.asarray(x[None], jnp.int32) for x in (tokens, pos, seg))


def train_step(cfg: ModelConfig, params, t: int, segments: int):
  def grads(p, tokens, pos, seg):
    h = T.hidden_states(p, cfg, tokens, pos, seg)
    lp = T.token_logprobs(p, cfg, h, jnp.roll(tokens, -1, axis=1))
    return jnp.sum(lp * (seg > 0))

  return jax.jit(jax.grad(grads)), (params,) + packed_row(t, segments)


def prefill(cfg: ModelConfig, params, t: int, segments: int):
  del segments

  def run(p, tokens):
    cache = T.init_cache(cfg, 1, t, per_layer=True)
    h, cache = T.decode(p, cfg, tokens, cache, from_empty=True)
    return T.logits(p, cfg, h[:, -1]), cache

  return jax.jit(run), (T.to_decode_layout(params), packed_row(t, 1)[0])


PROGRAMS = {"train_step": train_step, "prefill": prefill}


def measure(program, cfg, params, t, segments, repeats, run_budget):
  fn, args = PROGRAMS[program](cfg, params, t, segments)
  compiled = fn.lower(*args).compile()
  peak = compiled_memory(compiled)[0]
  seconds = None
  if repeats and peak <= run_budget:
    seconds = common.time_fn(lambda: compiled(*args), repeats).median
  return peak, seconds


def max_tokens(cfg, params, points: dict, budget: int, degree: int, step: int, segments) -> int:
  """The longest T (a multiple of `step`) whose train step peak fits `budget`: the root of a
  polynomial fit of the measured peaks, then stepped down until the compiled program fits."""
  ts = np.array(sorted(points), float)
  coef = np.polyfit(ts, [points[int(t)] for t in ts], min(degree, len(ts) - 1))
  coef[-1] -= budget
  roots = [r.real for r in np.roots(coef) if abs(r.imag) < 1e-9 and r.real > 0]
  t = int(max(roots, default=step) // step * step)
  while t > step and measure("train_step", cfg, params, t, segments, 0, 0)[0] > budget:
    t -= step
  return t


def main():
  args = common.argument_parser(
      __doc__, lengths="4096,16384,32768", hidden=64, heads=4, kv_heads=2, head_dim=16,
      layers=2, vocab=256, block=(512, "attention_block_q and _k"),
      segments=(1, "sequences packed in the row"),
      impls=("dense,blockwise",
             "attention_impl values beside dense and blockwise (auto: the accelerator's)"),
      dtype=("float32", "compute dtype (cuDNN needs bfloat16)"),
      no_time=(False, "memory only: compile, never run"),
      run_budget_gib=(2.0, "time what fits this"), budget_gib=(1.0, "of max_tokens_in_budget"),
      repeats=2, token_step=1024).parse_args()
  lengths = [int(x) for x in args.lengths.split(",")]
  impls = ["dense", "blockwise"] + [i for i in args.impls.split(",")
                                    if i not in ("dense", "blockwise")]
  repeats = 0 if args.no_time else args.repeats
  base = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                     intermediate_size=2 * args.hidden, num_layers=args.layers,
                     num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                     max_position_embeddings=max(lengths), attention_block_q=args.block,
                     attention_block_k=args.block, dtype=args.dtype)
  params = T.init_params(base, jax.random.PRNGKey(0))
  print(f"backend={jax.default_backend()} devices={jax.device_count()} dims: D={args.hidden} "
        f"H={args.heads} K={args.kv_heads} Dh={args.head_dim} L={args.layers} "
        f"{args.dtype} block={args.block} segments={args.segments}")
  print(f"{'program':<11} {'T':>6} {'impl':<9} {'peak MiB':>10} {'time s':>8}")
  peaks, times = ({p: {i: {} for i in impls} for p in PROGRAMS} for _ in range(2))
  for program in PROGRAMS:
    for t in lengths:
      for impl in impls:
        cfg = base.replace(attention_impl=impl)
        peak, sec = measure(program, cfg, params, t, args.segments, repeats,
                            args.run_budget_gib * GIB)
        peaks[program][impl][t], times[program][impl][t] = peak, sec
        shown = "-" if sec is None else f"{sec:.3f}"
        print(f"{program:<11} {t:>6} {impl:<9} {peak / 2**20:>10.1f} {shown:>8}", flush=True)

  top, low = max(lengths), min(lengths)
  budget = int(args.budget_gib * GIB)
  fit = lambda impl, degree: max_tokens(base.replace(attention_impl=impl), params,
                                        peaks["train_step"][impl], budget, degree,
                                        args.token_step, args.segments)
  growth = {p: {i: peaks[p][i][top] / peaks[p][i][low] for i in impls} for p in PROGRAMS}
  print(f"peak growth T={low}->{top} ({top / low:.0f}x tokens): " + ", ".join(
      f"{p} {i} {growth[p][i]:.1f}x" for p in PROGRAMS for i in impls))
  ratio = lambda p: peaks[p]["blockwise"][top] / peaks[p]["dense"][top]
  common.emit({
      **common.host_info(), "peak_mem_ratio_32k": ratio("train_step"),
      "peak_mem_ratio_32k_prefill": ratio("prefill"), "max_tokens_in_budget": fit("blockwise", 1),
      "max_tokens_in_budget_dense": fit("dense", 2), "budget_gib": args.budget_gib,
      "largest_T": top,
      "peak_mib": {p: {i: {t: round(v / 2**20, 1) for t, v in peaks[p][i].items()} for i in impls}
                   for p in PROGRAMS},
      "time_s": times, "peak_growth": growth})


if __name__ == "__main__":
  main()
