"""Benchmark: tokens/s and MFU of the GRPO train step at Llama-3.2-1B's shapes (random init)
against a plain cross-entropy step, per `--shapes` (ROWSxROW_LEN:REMAT[:SEQS]): model FLOPs
(analysis/scale_model.py) over the vendor's bf16 peak, and over a large matmul's rate here.

  python bench/train_mfu.py [--shapes 4x2048:none,1x8192:none,1x32768:full]
  python bench/train_mfu.py --attention_impl gpu_flash --steps grpo --shapes 1x32768:full:16

Last line, one JSON object, per shape: tokens_per_s_grpo, mfu_grpo, tokens_per_s_ce, mfu_ce,
grpo_over_ce_time, mfu_vs_matmul, peak memory, attention implementation, device.
"""
import common
import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.analysis import scale_model as M
from magistral_jax.model import attention as A
from magistral_jax.model import config as model_config
from magistral_jax.rl import collate as C
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.minibatch import collate_minibatch
from magistral_jax.run.footprint import compiled_memory
from magistral_jax.train import optimizer as O
from magistral_jax.train import step as S
from magistral_jax.train.sft import make_sft_step

PROMPT = 128


def matmul_tflops(n: int, dtype, reps: int = 10) -> float:
  """Achieved TFLOP/s of an n x n x n matmul on random data (zeros can run faster)."""
  ka, kb = jax.random.split(jax.random.PRNGKey(1))
  a = jax.random.normal(ka, (n, n), dtype)
  b = jax.random.normal(kb, (n, n), dtype)
  f = jax.jit(lambda a, b: a @ b)
  t = common.time_fn(lambda: f(a, b), reps, warmup=2).median
  return 2.0 * n ** 3 / t / 1e12


def make_batch(rows: int, row_len: int, micro: int, vocab: int, seed: int = 0, seqs: int = 1):
  """`rows * micro * seqs` sequences of row_len // seqs tokens, `seqs` packed per row, in groups
  of 2."""
  rng = np.random.default_rng(seed)
  n, n_tok = rows * micro * seqs, row_len // seqs
  if n_tok <= PROMPT:
    raise ValueError(f"{seqs} sequences per {row_len}-token row leave no completion after the "
                     f"{PROMPT}-token prompt")
  comps = [C.Completion(rng.integers(1, vocab, PROMPT), rng.integers(1, vocab, n_tok - PROMPT + 1),
                        -np.abs(rng.normal(2.0, 1.0, n_tok - PROMPT + 1)), float(rng.normal()),
                        i // 2) for i in range(n)]
  gcfg = GRPOConfig(microbatch_tokens=rows * row_len, microbatch_rows=rows, n_batch=n, n_mini=n,
                    group_size=2)
  mb = collate_minibatch(comps, gcfg)
  assert mb.arrays["tokens"].shape == (micro, rows, row_len), mb.arrays["tokens"].shape
  return gcfg, mb.arrays


def attention_impl(cfg, row_len: int) -> str:
  """The implementation model/attention.py takes for this shape's packed training rows here."""
  where = A.platform()
  choose = lambda ok=True: A.choose_impl(
      cfg.attention_impl, platform=where, dtype=cfg.jnp_dtype, head_dim=cfg.head_dim,
      q_len=row_len, kv_len=row_len, segments=True, self_only=True, window=cfg.sliding_window,
      block_q=cfg.attention_block_q, capability=A.cuda_capability() if where == "cuda" else 0.0,
      flash_compiles=ok)
  impl = choose()
  if impl == "gpu_flash" and cfg.attention_impl == "auto":
    impl = choose(A.gpu_flash_compiles(cfg.head_dim, cfg.dtype))
  return impl


def run_shape(base_cfg, rows: int, row_len: int, remat: str, args, peak_tf: float | None,
              mm_tf: float, seqs: int = 1) -> dict:
  cfg = base_cfg.replace(remat=remat, max_position_embeddings=max(row_len,
                                                                  base_cfg.max_position_embeddings))
  gcfg, batch = make_batch(rows, row_len, args.micro, cfg.vocab_size, seqs=seqs)
  batch = S.shard_batch(batch)
  tx = O.make_optimizer(O.OptimizerConfig(learning_rate=1e-6))
  state = S.init_state(cfg, tx, jax.random.PRNGKey(0))
  jax.block_until_ready(state)
  name = f"{rows}x{row_len}"
  out = {"shape": f"{args.micro} microbatches x [{rows} x {row_len}], {seqs} sequence(s) per "
                  f"row, remat {remat}",
         "tokens_per_step": args.micro * rows * row_len, "attention": attention_impl(cfg, row_len)}
  makers = {"grpo": lambda: S.make_grpo_step(cfg, gcfg, tx), "ce": lambda: make_sft_step(cfg, tx)}
  compiled = {}
  for k in args.steps.split(","):   # the makers' steps come jitted, donating
    compiled[k], out[f"compile_s_{k}"] = common.compile_timed(makers[k](), state, batch)
    out[f"peak_gib_{k}"] = compiled_memory(compiled[k])[0] / 2 ** 30
    print(f"[{name}] compiled {k} in {out[f'compile_s_{k}']:.1f}s, peak "
          f"{out[f'peak_gib_{k}']:.1f} GiB", flush=True)
  carry = common.Carry(state)
  times = common.time_rounds({k: carry.step(f, batch) for k, f in compiled.items()}, args.repeats)
  flops = M.train_flops_per_token(cfg, row_len // seqs) * out["tokens_per_step"]
  out["model_tflop_per_step"] = flops / 1e12
  for k, t in times.items():
    s = t.median
    out.update({f"step_s_{k}": s, f"tokens_per_s_{k}": out["tokens_per_step"] / s,
                f"mfu_vs_matmul_{k}": flops / s / 1e12 / mm_tf})
    if peak_tf:
      out[f"mfu_{k}"] = flops / s / 1e12 / peak_tf
  if "grpo" in times and "ce" in times:
    out["grpo_over_ce_time"] = out["step_s_grpo"] / out["step_s_ce"]
  print(f"[{name}] attention {out['attention']}; "
        + ", ".join(f"{k}: {out[f'step_s_{k}']:.3f}s/step, {out[f'tokens_per_s_{k}']:,.0f} "
                    f"tok/s, MFU {out.get(f'mfu_{k}', float('nan')):.3f}" for k in times)
        + (f"; grpo/ce {out['grpo_over_ce_time']:.3f}" if "grpo_over_ce_time" in out else ""),
        flush=True)
  del carry, state, compiled
  return out


def main(argv=None):
  ap = common.argument_parser(
      __doc__, shapes=("4x2048:none,1x8192:none,1x32768:full",
                       "ROWSxROW_LEN:REMAT[:SEQS], comma-separated"),
      steps=("grpo,ce", "the steps timed: grpo, ce or both"),
      micro=(2, "microbatches per optimizer step"), param_dtype="float32", dtype="bfloat16",
      attention_impl="auto", layers=(int, "fewer layers (a CPU smoke run)"),
      hidden=(int, "a smaller hidden size (smoke run)"), matmul_n=8192, repeats=5)
  args = ap.parse_args(argv)
  if not args.steps or set(args.steps.split(",")) - {"grpo", "ce"}:
    ap.error(f"--steps: grpo, ce or grpo,ce, got {args.steps!r}")

  cfg = model_config.LLAMA_3_2_1B.replace(param_dtype=args.param_dtype, dtype=args.dtype,
                                          attention_impl=args.attention_impl)
  if args.layers:
    cfg = cfg.replace(num_layers=args.layers)
  if args.hidden:
    cfg = cfg.replace(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 256),
                      vocab_size=8192)
  dev = jax.devices()[0]
  peak_tf = M.vendor_peak(dev.device_kind)[0] if dev.platform != "cpu" else None
  mm_tf = matmul_tflops(args.matmul_n, jnp.dtype(args.dtype))
  result = {"model": "Llama-3.2-1B shapes (random init)" if not (args.layers or args.hidden)
            else f"Llama-3.2-1B shrunk (layers {cfg.num_layers}, hidden {cfg.hidden_size})",
            "params": cfg.num_params(), "param_dtype": args.param_dtype, "dtype": args.dtype,
            "attention_impl": args.attention_impl, "device": dev.device_kind,
            "platform": dev.platform, "jax": jax.__version__, "spec_bf16_tflops": peak_tf,
            "matmul_tflops": mm_tf}
  print(f"[device] {dev.device_kind}: {args.matmul_n}^3 {args.dtype} matmul {mm_tf:.0f} TFLOP/s "
        f"(spec {peak_tf})", flush=True)
  for spec in args.shapes.split(","):
    dims, _, rest = spec.partition(":")
    remat, _, seqs = rest.partition(":")
    rows, row_len = (int(x) for x in dims.split("x"))
    key = f"{rows}x{row_len}" + (f"_{seqs}seqs" if seqs and int(seqs) > 1 else "")
    try:
      r = run_shape(cfg, rows, row_len, remat or "none", args, peak_tf, mm_tf, int(seqs or 1))
    except Exception as e:   # e.g. out of memory at the longest shape: the others still count
      print(f"[{key}] failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
      result[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
      continue
    result.update({f"{key}_{k}": v for k, v in r.items()})
  common.emit(result, ndigits=4)


if __name__ == "__main__":
  main()
