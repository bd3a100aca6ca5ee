"""Benchmark: our jitted SmolLM2-135M scoring forward (per-token log-probs) and KV-cache greedy
decode against transformers on the same weights, dtype and threads; each decode timed with 64 new
tokens and with 1, so the decode phase separates from the prefill.

  python bench/model_forward.py [--repeats 5]

Last line, one JSON object: forward_speedup, forward_speedup_vs_hf_logits, decode_speedup,
decode_only_speedup, decode_step_ms and each side's tokens/s.
"""
import os

import common
import jax
import jax.numpy as jnp
import numpy as np


def main():
  from magistral_jax.model import named
  args = common.argument_parser(
      __doc__, batch=8, prompt=128, new_tokens=64, skip_hf=False,
      repeats=(3, "rounds of every program, ours and HF")).parse_args()

  import torch
  from magistral_jax.generate.xla_cpu import generate_compiler_options
  from magistral_jax.model import transformer as T

  torch.set_num_threads(os.cpu_count())
  # Device arrays: numpy leaves would be copied on every call of the jitted functions.
  cfg, params, _, path = named.load_model("smollm2", "float32", "gguf")
  params = jax.block_until_ready(params)
  b, s, n = args.batch, args.prompt, args.new_tokens
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (b, s)).astype(np.int32)

  # --- ours: scoring forward (per-token log-probs of the next token, chunked head) ---
  @jax.jit
  def score(p, t):
    h = T.hidden_states(p, cfg, t)
    return T.token_logprobs(p, cfg, h, jnp.roll(t, -1, axis=1))
  tok_j = jnp.asarray(tokens)

  # --- ours: greedy decode with the KV cache: a prefill program, then one program of n - 1 steps
  dec_params = jax.block_until_ready(jax.jit(T.to_decode_layout)(params))

  @jax.jit
  def prefill(p, t):
    cache = T.init_cache(cfg, b, s + n)
    h, cache = T.decode(p, cfg, t, cache)
    return jnp.argmax(T.logits(p, cfg, h[:, -1]), -1), cache

  def steps(p, first, cache):
    def step(carry, _):
      tok, cache = carry
      lg, cache = T.decode_logits(p, cfg, tok[:, None], cache)
      return (jnp.argmax(lg[:, -1], -1), cache), tok
    # n - 1 KV-cache steps: the scan emits each step's input token, the carry holds the last.
    (last, _), out = jax.lax.scan(step, (first, cache), None, length=n - 1)
    return jnp.concatenate([out.T, last[:, None]], axis=1)
  opts = generate_compiler_options(jax.default_backend(), b)
  steps = jax.jit(steps, donate_argnums=2, compiler_options=opts)
  greedy1 = lambda p, t: prefill(p, t)[0][:, None]
  greedy = lambda p, t: steps(p, *prefill(p, t))
  ours_tokens = np.asarray(greedy(dec_params, tok_j))
  fns = {"fwd": lambda: score(params, tok_j).block_until_ready(),
         "dec": lambda: greedy(dec_params, tok_j).block_until_ready(),
         "pre": lambda: greedy1(dec_params, tok_j).block_until_ready()}

  if not args.skip_hf:
    hf = common.hf_causal_lm(path, "float32").eval()
    tt = torch.tensor(tokens, dtype=torch.long)
    targets = tt.roll(-1, 1)[..., None]
    def hf_score():  # per-token log-probs of the same targets as ours
      return torch.log_softmax(hf(tt).logits.float(), -1).gather(-1, targets)
    gen = lambda new=n: hf.generate(tt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                    eos_token_id=None, pad_token_id=0, use_cache=True)
    fns.update(hf_logits=lambda: hf(tt).logits, hf_fwd=hf_score, hf_dec=gen,
               hf_pre=lambda: gen(1))
  with torch.inference_mode():
    t = {k: v.median for k, v in common.time_rounds(fns, args.repeats, block=False).items()}

  def rates(side):   # "" (ours) or "hf_"
    f, d, p = (t[side + k] for k in ("fwd", "dec", "pre"))
    return {f"{side}forward_tokens_per_s": b * s / f, f"{side}decode_tokens_per_s": b * n / d,
            f"{side}decode_only_tokens_per_s": b * (n - 1) / (d - p),
            f"{side}decode_step_ms": 1e3 * (d - p) / (n - 1), f"{side}prefill_s": p}
  result = {**common.host_info(), "jax_backend": jax.default_backend(), "batch": b, "prompt": s,
            "new_tokens": n, **rates("")}
  if not args.skip_hf:
    with torch.inference_mode():
      hf_tokens = gen()[:, s:].numpy()
      ref_logits = hf(tt[:2]).logits.numpy()
    ours_logits = np.asarray(jax.jit(lambda p, t: T.forward_logits(p, cfg, t))(params, tok_j[:2]))
    result.update({
        **rates("hf_"), "forward_speedup": t["hf_fwd"] / t["fwd"],
        "decode_speedup": t["hf_dec"] / t["dec"],
        "decode_only_speedup": (t["hf_dec"] - t["hf_pre"]) / (t["dec"] - t["pre"]),
        "hf_logits_tokens_per_s": b * s / t["hf_logits"],
        "forward_speedup_vs_hf_logits": t["hf_logits"] / t["fwd"],
        "max_abs_logit_diff_vs_hf": float(np.max(np.abs(ours_logits - ref_logits))),
        "greedy_tokens_agree_frac": float(np.mean(ours_tokens == hf_tokens)),
    })
  common.emit(result)


if __name__ == "__main__":
  main()
