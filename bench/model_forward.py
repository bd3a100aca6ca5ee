"""Benchmark: our jitted SmolLM2-135M scoring forward and KV-cache greedy decode vs transformers.

Baseline: transformers (torch, CPU) on the same dequantized GGUF weights, same dtype (fp32), same
thread count, batch 8, prompt 128. Both sides hold their weights in their own device memory
before timing (torch tensors; for us jax arrays, as the trainer and the engine hold them).

Forward = one scoring pass over the batch: the log-prob of every next token (tokens/s counts
prompt tokens). Ours is `hidden_states` + `token_logprobs`. The transformers equivalent, and the
baseline of `forward_speedup`, is its forward followed by log_softmax and a gather of the same
targets (how torch RL code turns logits into per-token log-probs). HF's logits-only forward is
reported too (`hf_logits_tokens_per_s`, `forward_speedup_vs_hf_logits`), since it does less work.

Decode = greedy generation with a KV cache after a 128-token prefill, on both sides. Ours holds its
weights in the decode layout the generation engine uses (transformer.to_decode_layout: one array
per layer, converted once before timing, as HF holds its own layout) and runs two jitted programs,
as the engine does: a prefill that projects only the last position onto the vocab (as HF generate
does), then a scan of single-token steps, compiled with the engine's generate options for that
batch.
Each side is timed twice: with 64 new tokens (T64) and with 1 (T1: the prefill, whose
last-position logits give the first token).
- `decode_tokens_per_s` (and `decode_speedup`, the issue's figure) is end to end, prefill
  included: b * 64 / T64. The prefill is the same 8 x 128-token matmul work as the forward above,
  at kernel parity with torch on CPU, so this ratio is pulled towards the forward's.
- `decode_only_tokens_per_s` (and `decode_only_speedup`) is the decode phase by itself: the 63
  tokens that come from KV-cache steps, b * 63 / (T64 - T1); `decode_step_ms` per step.

Every time is the median of --repeats rounds after a warm-up (bench/common.py); each round runs
every program once, ours and transformers' in turn.
Last line: one JSON object.
"""
import os

import common
import jax
import jax.numpy as jnp
import numpy as np


def main():
  ap = common.argument_parser(__doc__)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=128)
  ap.add_argument("--new_tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3,
                  help="timing rounds; each runs every measured program once, ours and HF in turn")
  ap.add_argument("--skip_hf", action="store_true")
  args = ap.parse_args()

  import torch
  import transformers
  from magistral_jax.generate.cpu_options import generate_compiler_options
  from magistral_jax.model import transformer as T

  threads = os.cpu_count()
  torch.set_num_threads(threads)
  # Device arrays: numpy leaves would be copied on every call of the jitted functions.
  cfg, params, _, path = common.load_model("smollm2", "float32", "gguf")
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
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32)
    hf.eval()
    tt = torch.tensor(tokens, dtype=torch.long)
    targets = tt.roll(-1, 1)[..., None]
    def hf_score():  # per-token log-probs of the same targets as ours
      return torch.log_softmax(hf(tt).logits.float(), -1).gather(-1, targets)
    gen = lambda new=n: hf.generate(tt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                    eos_token_id=None, pad_token_id=0, use_cache=True)
    fns.update(hf_logits=lambda: hf(tt).logits, hf_fwd=hf_score, hf_dec=gen,
               hf_pre=lambda: gen(1))
  # Every round runs each program once, ours and transformers' in turn, so both see the same
  # host conditions (a shared host's speed drifts by 1.5x over minutes).
  with torch.inference_mode():
    t = {k: v.median for k, v in common.time_rounds(fns, args.repeats, block=False).items()}
  fwd_s, dec_s, pre_s = t["fwd"], t["dec"], t["pre"]

  result = {
      **common.host_info(), "jax_backend": jax.default_backend(), "batch": b, "prompt": s,
      "new_tokens": n, "forward_tokens_per_s": b * s / fwd_s,
      "decode_tokens_per_s": b * n / dec_s, "decode_only_tokens_per_s": b * (n - 1) / (dec_s - pre_s),
      "decode_step_ms": 1e3 * (dec_s - pre_s) / (n - 1), "prefill_s": pre_s,
  }
  if not args.skip_hf:
    hf_logits_s, hf_fwd_s, hf_dec_s, hf_pre_s = (t[k] for k in ("hf_logits", "hf_fwd", "hf_dec",
                                                                 "hf_pre"))
    with torch.inference_mode():
      hf_tokens = gen()[:, s:].numpy()
      ref_logits = hf(tt[:2]).logits.numpy()
    ours_logits = np.asarray(jax.jit(lambda p, t: T.forward_logits(p, cfg, t))(params, tok_j[:2]))
    result.update({
        "hf_forward_tokens_per_s": b * s / hf_fwd_s,
        "hf_decode_tokens_per_s": b * n / hf_dec_s,
        "hf_decode_only_tokens_per_s": b * (n - 1) / (hf_dec_s - hf_pre_s),
        "hf_decode_step_ms": 1e3 * (hf_dec_s - hf_pre_s) / (n - 1), "hf_prefill_s": hf_pre_s,
        "forward_speedup": hf_fwd_s / fwd_s,
        "decode_speedup": hf_dec_s / dec_s,
        "decode_only_speedup": (hf_dec_s - hf_pre_s) / (dec_s - pre_s),
        "hf_logits_tokens_per_s": b * s / hf_logits_s,
        "forward_speedup_vs_hf_logits": hf_logits_s / fwd_s,
        "max_abs_logit_diff_vs_hf": float(np.max(np.abs(ours_logits - ref_logits))),
        "greedy_tokens_agree_frac": float(np.mean(ours_tokens == hf_tokens)),
    })
  common.emit(result)


if __name__ == "__main__":
  main()
