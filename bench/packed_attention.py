"""Benchmark: packed-row attention forward + backward (one row of T tokens of random-length
sequences, Llama-3.2-1B's heads, bf16): our Pallas flash kernel with and without block-sparse
skipping (model/flash_sparse.py) and cuDNN's packed layout, checked then timed against blockwise.
On CPU the Pallas kernels run interpreted (times not meaningful; the JSON says so).

  python bench/packed_attention.py [--lengths 8192,32768,65536] [--impls flash,...]

Last line, one JSON object per T: <T>_rel_err_<kernel>_*, <T>_fwd_bwd_ms_<kernel>,
<T>_blockwise_over_<kernel>_time, <T>_flash_noskip_over_flash_time, <T>_visited_tile_fraction.
"""
import math

import common
import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.model import attention as A
from magistral_jax.model import flash_sparse as FS
from magistral_jax.model.blockwise_attention import blockwise_attention

IMPLS = ("flash", "flash_noskip", "cudnn", "jax_mha")


def packed_row(t: int, mean_len: int, rng) -> tuple[np.ndarray, np.ndarray]:
  seg, pos = np.zeros((1, t), np.int32), np.zeros((1, t), np.int32)
  o, i = 0, 1
  while o < t - t // 16:   # leave a padding tail
    n = int(min(max(8, rng.exponential(mean_len)), t - t // 16 - o))
    seg[0, o:o + n], pos[0, o:o + n] = i, np.arange(n)
    o, i = o + n, i + 1
  return seg, pos


def jax_mha(q, keys, values, segments, interpret):
  """jax's Pallas GPU kernel, each KV head repeated over its query heads (it takes no GQA)."""
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention
  g = q.shape[2] // keys.shape[1]
  rep = lambda x: jnp.repeat(x, g, axis=1).swapaxes(1, 2)
  return gpu_attention.mha(q, rep(keys), rep(values), segments,
                           sm_scale=1.0 / math.sqrt(q.shape[-1]), causal=True,
                           interpret=interpret)


def kernels(t: int, segments, blocks: FS.Blocks, impls, blockwise, on_cpu: bool) -> dict:
  """name -> f(q, keys, values), the kernels of --impls that apply at this T and platform."""
  out = {}
  for name in impls:
    if name in ("flash", "flash_noskip"):   # with and without the block-sparse skipping
      out[name] = lambda q, k, v, skip=name == "flash": FS.flash_attention(
          q, k, v, segments, skip=skip, blocks=blocks, interpret=on_cpu)
    elif name == "cudnn" and not on_cpu and t <= A.CUDNN_PACKED_MAX_T:
      out[name] = lambda q, k, v: A.cudnn_packed_attention(q, k, v, segments,
                                                           lambda: blockwise(q, k, v))
    elif name == "jax_mha":
      out[name] = lambda q, k, v: jax_mha(q, k, v, segments, on_cpu)
  return out


def main(argv=None):
  ap = common.argument_parser(
      __doc__, lengths=(str, "comma-separated row lengths (default 2048,8192,32768; 512 on a CPU)"),
      impls=("flash,flash_noskip,cudnn", f"kernels timed beside blockwise, from {IMPLS}"),
      blocks=(str, "the kernel's tiles q,k,bwd_q,bwd_k"), mean_len=1024, repeats=5)
  args = ap.parse_args(argv)
  impls = [x for x in args.impls.split(",") if x]
  if set(impls) - set(IMPLS):
    ap.error(f"--impls: unknown {sorted(set(impls) - set(IMPLS))}; known {IMPLS}")
  blocks = FS.Blocks(*(int(x) for x in args.blocks.split(","))) if args.blocks else FS.Blocks()
  dev = jax.devices()[0]
  on_cpu = dev.platform == "cpu"
  lengths = args.lengths or ("512" if on_cpu else "2048,8192,32768")
  result = {"device": dev.device_kind, "capability": A.cuda_capability(), "jax": jax.__version__,
            "blocks": f"q {blocks.q}, k {blocks.k}, bwd_q {blocks.bwd_q}, bwd_k {blocks.bwd_k}"}
  if on_cpu:
    result["note"] = ("CPU: the Pallas kernels ran in Pallas's interpreter (their times measure "
                      "the interpreter, not the kernels); cuDNN skipped")
  h, k, dh = 32, 8, 64
  for t in (int(x) for x in lengths.split(",")):
    seg, pos = packed_row(t, min(args.mean_len, t // 8), np.random.default_rng(t))
    spec = A.packed_spec(jnp.asarray(pos), jnp.asarray(seg))
    keys = jax.random.split(jax.random.PRNGKey(t), 4)
    q = jax.random.normal(keys[0], (1, t, h, dh), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (1, k, t, dh), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, k, t, dh), jnp.bfloat16)
    ct = jax.random.normal(keys[3], q.shape, jnp.bfloat16) * jnp.asarray(seg > 0)[:, :, None, None]
    blockwise = lambda q, kk, v: blockwise_attention(q, kk, v, spec, window=None, block_q=512,
                                                     block_k=512)

    def fwd_bwd(f):
      def run(q, kk, v):
        out, vjp = jax.vjp(f, q, kk, v)
        return (out,) + vjp(ct)
      return jax.jit(run)

    real = np.asarray(seg > 0)[0]
    timed = {"blockwise": fwd_bwd(blockwise)}
    want = timed["blockwise"](q, kk, v)
    for name, f in kernels(t, spec.q_seg, blocks, impls, blockwise, on_cpu).items():
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
    if "flash" in tm and "flash_noskip" in tm:
      result[f"{t}_flash_noskip_over_flash_time"] = tm["flash_noskip"].median / tm["flash"].median
    visited, triangle = (FS.tile_counts(spec.q_seg, blocks.q, blocks.k, skip)[0].sum()
                         for skip in (True, False))
    result[f"{t}_visited_tile_fraction"] = float(visited / triangle)
    result[f"{t}_segments"] = int(seg.max())
    print({k_: v_ for k_, v_ in result.items() if k_.startswith(f"{t}_")}, flush=True)
  common.emit(result, ndigits=5)


if __name__ == "__main__":
  main()
