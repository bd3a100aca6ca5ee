"""Benchmark: one layer's decode attention for `--slots` slots of long-tailed live lengths:
`dense`, the baseline, over a contiguous cache masked by length, against model/paged_attention.py
over a pool of the same tokens, `ragged` and (on a GPU) `pallas_gpu`; `in_flight_ratio`: the
sequences a paged pool of the dense cache's memory holds, over its slots.

  python bench/paged_attention.py [--slots 16] [--cache 8192]          (CPU: SmolLM2-135M's heads)
  python bench/paged_attention.py --gpu                                (Small's per-chip shapes)

Last line: {"bench": "paged_attention", "runs": [{slots, impl: {step_ms, kv_read_over_live,
live_gb_per_s[, of_copy_bandwidth]}, paged_over_dense_step, in_flight_ratio}], ...}.
"""
import math

import common

import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.model import paged_attention as pa


def lengths_for(slots: int, cache: int, mean_frac: float, tail: int, seed: int) -> np.ndarray:
  n = common.lognormal_lengths(np.random.default_rng(seed), mean_frac * cache, slots, cache)
  n[:min(tail, slots)] = cache
  if slots <= 4:   # the long tail of a batch: the few slots left are the long ones
    n[:] = cache
  return n


def dense_contiguous(q, k, v, lengths):
  """The baseline: q [B, Hq, Dh] against a contiguous cache k/v [B, S, Hkv, Dh], masked."""
  b, hq, dh = q.shape
  hkv = k.shape[2]
  qg = q.reshape(b, hkv, hq // hkv, dh)
  s = jnp.einsum("bkgd,bskd->bkgs", qg, k, preferred_element_type=jnp.float32) / math.sqrt(dh)
  live = jnp.arange(k.shape[1])[None] < lengths[:, None]
  s = jnp.where(live[:, None, None], s, -1e30)
  w = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bkgs,bskd->bkgd", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return o.reshape(q.shape).astype(q.dtype)


def one_run(slots: int, args, rng_seed: int) -> dict:
  dtype = jnp.dtype(args.dtype)
  ps, s = args.page_size, args.cache
  max_pages = s // ps
  lengths = lengths_for(slots, s, args.mean_frac, args.tail if slots > args.tail else 0, rng_seed)
  live_pages = pa.pages_for(lengths, ps)
  r = np.random.default_rng(rng_seed)
  shape = (slots, s, args.kv_heads, args.head_dim)
  k_np = r.standard_normal(shape, np.float32)
  v_np = r.standard_normal(shape, np.float32)
  k, v = jnp.asarray(k_np, dtype), jnp.asarray(v_np, dtype)
  q = jnp.asarray(r.standard_normal((slots, args.q_heads, args.head_dim), np.float32), dtype)
  n = jnp.asarray(lengths)
  # The pool: only the live pages, laid out as the allocator would (page 0 null).
  table = np.zeros((slots, max_pages), np.int32)
  table[np.arange(max_pages)[None] < live_pages[:, None]] = 1 + np.arange(int(live_pages.sum()))

  def pool_of(x):   # the same tokens as the dense cache, page by page, after the null page
    live = [x[b, :live_pages[b] * ps].reshape(live_pages[b], ps, *x.shape[2:])
            for b in range(slots)]
    pages = np.concatenate([np.zeros((1, ps, *x.shape[2:]), x.dtype)] + live)
    return jnp.asarray(pages.transpose(2, 0, 1, 3), dtype)
  kp, vp = pool_of(k_np), pool_of(v_np)
  t = jnp.asarray(table)
  fns = {"dense": (jax.jit(dense_contiguous), (q, k, v, n)),
         "ragged": (jax.jit(pa.ragged), (q, kp, vp, t, n))}
  if args.gpu:   # on CPU (the mode's rehearsal) the kernel runs in Pallas's interpreter
    gpu = jax.jit(pa.pallas_gpu, static_argnames="interpret")
    fns["pallas_gpu"] = (lambda *a: gpu(*a, interpret=jax.default_backend() == "cpu"),
                         (q, kp, vp, t, n))
  want = np.asarray(fns["dense"][0](*fns["dense"][1]), np.float32)
  bpp = 2 * args.kv_heads * args.head_dim * dtype.itemsize        # K and V, per position
  live_bytes = int(lengths.sum()) * bpp
  out = dict(slots=slots, mean_live=float(lengths.mean()), cache=s,
             live_fraction=float(lengths.mean() / s))
  bw = (common.stream_bandwidth(jax.devices()[0], args.copy_mb << 20, args.repeats)["copy_GBps"]
        * 1e9 if args.gpu else None)
  calls = {name: (lambda f=f, a=a: f(*a)) for name, (f, a) in fns.items()}
  timings = common.time_rounds(calls, args.repeats, alternate=True)   # dense and paged in turn
  for name, t in timings.items():
    err = float(np.abs(np.asarray(t.result, np.float32) - want).max())
    if err > (1e-3 if dtype == jnp.float32 else 5e-2):
      raise AssertionError(f"{name} differs from dense by {err} at {slots} slots")
    sec = t.median
    read = (slots * s * bpp if name == "dense" else
            pa.bytes_read(name, lengths, ps, max_pages, bpp))
    row = dict(step_ms=sec * 1e3, kv_read_over_live=read / live_bytes,
               live_gb_per_s=live_bytes / sec / 1e9, max_abs_err=err)
    if bw:
      row["of_copy_bandwidth"] = live_bytes / sec / bw
    out[name] = row
  best = min((k for k in fns if k != "dense"), key=lambda k: out[k]["step_ms"])
  out["paged_over_dense_step"] = out["dense"]["step_ms"] / out[best]["step_ms"]
  out["best_paged"] = best
  out["in_flight_ratio"] = (slots * max_pages // max(1, int(np.ceil(live_pages.mean())))) / slots
  return out


def main():
  a = common.argument_parser(
      __doc__, gpu=(False, "Small's per-chip shapes, + pallas_gpu"),
      slots=(str, "comma list of slot counts"), cache=(int, "positions per slot"),
      mean_frac=(0.2, "mean live length / cache"), tail=(1, "slots at full length (the long tail)"),
      page_size=int, q_heads=int, kv_heads=int, head_dim=int, dtype=str, repeats=5, seed=0,
      copy_mb=(1024, "--gpu: the bandwidth probe's size")).parse_args()
  # CPU: SmolLM2-135M's attention (9 query / 3 KV heads of 64), an 8K cache; GPU: Small's
  # per-chip shapes (8 query / 2 KV heads of 128, bf16, 45,056 positions) and a 4-slot tail.
  cpu = dict(slots="16", cache=8192, page_size=64, q_heads=9, kv_heads=3, head_dim=64,
             dtype="float32")
  gpu = dict(slots="31,64,128,4", cache=45056, page_size=64, q_heads=8, kv_heads=2,
             head_dim=128, dtype="bfloat16")
  for key, value in (gpu if a.gpu else cpu).items():
    if getattr(a, key) is None:
      setattr(a, key, value)
  runs = [one_run(int(b), a, a.seed + i) for i, b in enumerate(a.slots.split(","))]
  common.emit(dict(bench="paged_attention", backend=jax.default_backend(), page_size=a.page_size,
                   q_heads=a.q_heads, kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=a.dtype,
                   mean_frac=a.mean_frac, runs=runs, host=common.host_info()), ndigits=4)


if __name__ == "__main__":
  main()
