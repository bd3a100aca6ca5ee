"""Benchmark: packed-row attention (several sequences per row, causal within each) through
cuDNN's packed layout and the Pallas GPU flash kernel against the blockwise baseline, on an
NVIDIA GPU (cuDNN's packed layout: sm90+, rows up to attention.CUDNN_PACKED_MAX_T tokens).

For each T in --lengths, one row of T tokens holding sequences of random lengths (mean
--mean_len) and a padding tail, the Llama-3.2-1B attention shape (32 query heads, 8 KV heads,
head_dim 64), bf16:
  check  each kernel's output and its gradients (q, k, v) against blockwise's, as
         ||got - want|| / ||want|| on the real (non-padding) tokens (bf16 operands: expect
         1e-3 to 1e-2; NaN fails).
  time   forward + backward of each (the median of --repeats after a warm-up).
Last line: one JSON object with `<T>_rel_err_<kernel>_*`, `<T>_fwd_bwd_ms_<kernel>` and
`<T>_blockwise_over_<kernel>_time` per T (a kernel that fails: `<T>_error_<kernel>`).
Usage: python bench/packed_attention.py [--lengths 2048,8192,32768]
"""
from __future__ import annotations

import common
import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.model import attention as A
from magistral_jax.model.blockwise_attention import blockwise_attention


def packed_row(t: int, mean_len: int, rng) -> tuple[np.ndarray, np.ndarray]:
  seg, pos = np.zeros((1, t), np.int32), np.zeros((1, t), np.int32)
  o, i = 0, 1
  while o < t - t // 16:   # leave a padding tail
    n = int(min(max(8, rng.exponential(mean_len)), t - t // 16 - o))
    seg[0, o:o + n], pos[0, o:o + n] = i, np.arange(n)
    o, i = o + n, i + 1
  return seg, pos


def main(argv=None):
  ap = common.argument_parser(__doc__)
  ap.add_argument("--lengths", default="2048,8192,32768")
  ap.add_argument("--mean_len", type=int, default=1024)
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args(argv)
  rng = np.random.default_rng(0)
  dev = jax.devices()[0]
  result = {"device": dev.device_kind, "capability": A.cuda_capability(), "jax": jax.__version__}
  h, k, dh = 32, 8, 64
  for t in (int(x) for x in args.lengths.split(",")):
    seg, pos = packed_row(t, args.mean_len, rng)
    spec = A.packed_spec(jnp.asarray(pos), jnp.asarray(seg))
    keys = jax.random.split(jax.random.PRNGKey(t), 4)
    q = jax.random.normal(keys[0], (1, t, h, dh), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (1, k, t, dh), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, k, t, dh), jnp.bfloat16)
    ct = jax.random.normal(keys[3], q.shape, jnp.bfloat16) * jnp.asarray(seg > 0)[:, :, None, None]
    blockwise = lambda q, kk, v: blockwise_attention(q, kk, v, spec, window=None, block_q=512,
                                                     block_k=512)
    kernels = {"gpu_flash": lambda q, kk, v: A.gpu_flash_attention(q, kk, v, spec.q_seg)}
    if t <= A.CUDNN_PACKED_MAX_T:
      kernels["cudnn"] = lambda q, kk, v: A.cudnn_packed_attention(q, kk, v, spec.q_seg,
                                                                   lambda: blockwise(q, kk, v))

    def fwd_bwd(f):
      def run(q, kk, v):
        out, vjp = jax.vjp(f, q, kk, v)
        return (out,) + vjp(ct)
      return jax.jit(run)

    real = np.asarray(seg > 0)[0]
    timed = {"blockwise": fwd_bwd(blockwise)}
    want = timed["blockwise"](q, kk, v)
    for name, f in kernels.items():
      try:
        fn = fwd_bwd(f)
        got = fn(q, kk, v)
        for part, g, w in zip(("out", "dq", "dk", "dv"), got, want):
          g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
          if part in ("out", "dq"):
            g, w = g[:, real], w[:, real]
          result[f"{t}_rel_err_{name}_{part}"] = float(np.linalg.norm(g - w) / np.linalg.norm(w))
        timed[name] = fn
      except Exception as e:   # report it and time the others
        result[f"{t}_error_{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
    tm = common.time_rounds({n: (lambda f=f: f(q, kk, v)) for n, f in timed.items()},
                            args.repeats)
    for n, x in tm.items():
      result[f"{t}_fwd_bwd_ms_{n}"] = x.median * 1e3
      if n != "blockwise":
        result[f"{t}_blockwise_over_{n}_time"] = tm["blockwise"].median / x.median
    result[f"{t}_segments"] = int(seg.max())
    print({k_: v_ for k_, v_ in result.items() if k_.startswith(f"{t}_")}, flush=True)
  common.emit(result, ndigits=5)


if __name__ == "__main__":
  main()
