"""Benchmark: our jitted SmolLM2-135M scoring forward and KV-cache greedy decode vs transformers.

Baseline: transformers (torch, CPU) on the same dequantized GGUF weights, same dtype (fp32), same
thread count, batch 8, prompt 128. Both sides hold their weights in their own device memory
before timing (torch tensors; for us jax arrays, as the trainer and the engine hold them).

Forward = one scoring pass over the batch: the log-prob of every next token (tokens/s counts
prompt tokens). Ours is `hidden_states` + `token_logprobs`. The transformers equivalent, and the
baseline of `forward_speedup`, is its forward followed by log_softmax and a gather of the same
targets (how torch RL code turns logits into per-token log-probs). HF's logits-only forward is
reported too (`hf_logits_tokens_per_s`, `forward_speedup_vs_hf_logits`), since it does less work.

Decode = 64 greedy tokens per sequence after a 128-token prefill, with a KV cache on both sides
(tokens/s counts generated tokens; prefill included in the time on both sides). Ours is one jitted
program: a prefill that projects only the last position onto the vocab (as the engine's prefill
and HF generate do), then a scan of 64 single-token steps.

Last line: one JSON object.
"""
import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def _time(fn, repeats):
  fn()  # warm-up / compile
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t)
  return best


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=128)
  ap.add_argument("--new_tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--skip_hf", action="store_true")
  args = ap.parse_args()

  import torch
  import transformers
  from magistral_jax.model import checkpoint as ckpt
  from magistral_jax.model import transformer as T

  threads = os.cpu_count()
  torch.set_num_threads(threads)
  path = ckpt.default_gguf_path()
  cfg, params, _ = ckpt.load_gguf(path, with_tokenizer=False)
  params = jax.block_until_ready(jax.device_put(params))  # numpy leaves would be copied per call
  b, s, n = args.batch, args.prompt, args.new_tokens
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (b, s)).astype(np.int32)

  # --- ours: scoring forward (per-token log-probs of the next token, chunked head) ---
  @jax.jit
  def score(p, t):
    h = T.hidden_states(p, cfg, t)
    return T.token_logprobs(p, cfg, h, jnp.roll(t, -1, axis=1))
  tok_j = jnp.asarray(tokens)
  fwd_s = _time(lambda: score(params, tok_j).block_until_ready(), args.repeats)

  # --- ours: greedy decode with the KV cache, the whole loop in one jitted program ---
  @jax.jit
  def greedy(p, t):
    cache = T.init_cache(cfg, b, s + n)
    h, cache = T.decode(p, cfg, t, cache)
    first = jnp.argmax(T.logits(p, cfg, h[:, -1]), -1)
    def step(carry, _):
      tok, cache = carry
      lg, cache = T.decode_logits(p, cfg, tok[:, None], cache)
      nxt = jnp.argmax(lg[:, -1], -1)
      return (nxt, cache), tok
    (_, _), out = jax.lax.scan(step, (first, cache), None, length=n)
    return out.T
  dec_s = _time(lambda: greedy(params, tok_j).block_until_ready(), args.repeats)
  ours_tokens = np.asarray(greedy(params, tok_j))

  result = {
      "machine": f"cpu x{threads}", "loadavg": open("/proc/loadavg").read().split()[:3], "jax_backend": jax.default_backend(), "batch": b, "prompt": s,
      "new_tokens": n, "forward_tokens_per_s": b * s / fwd_s, "decode_tokens_per_s": b * n / dec_s,
  }
  if not args.skip_hf:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32)
    hf.eval()
    tt = torch.tensor(tokens, dtype=torch.long)
    targets = tt.roll(-1, 1)[..., None]
    def hf_score():  # per-token log-probs of the same targets as ours
      return torch.log_softmax(hf(tt).logits.float(), -1).gather(-1, targets)
    with torch.inference_mode():
      hf_logits_s = _time(lambda: hf(tt).logits, args.repeats)
      hf_fwd_s = _time(hf_score, args.repeats)
      gen = lambda: hf.generate(tt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0, use_cache=True)
      hf_dec_s = _time(gen, args.repeats)
      hf_tokens = gen()[:, s:].numpy()
      ref_logits = hf(tt[:2]).logits.numpy()
    ours_logits = np.asarray(jax.jit(lambda p, t: T.forward_logits(p, cfg, t))(params, tok_j[:2]))
    result.update({
        "hf_forward_tokens_per_s": b * s / hf_fwd_s, "hf_decode_tokens_per_s": b * n / hf_dec_s,
        "forward_speedup": hf_fwd_s / fwd_s, "decode_speedup": hf_dec_s / dec_s,
        "hf_logits_tokens_per_s": b * s / hf_logits_s,
        "forward_speedup_vs_hf_logits": hf_logits_s / fwd_s,
        "max_abs_logit_diff_vs_hf": float(np.max(np.abs(ours_logits - ref_logits))),
        "greedy_tokens_agree_frac": float(np.mean(ours_tokens == hf_tokens)),
    })
  print(json.dumps(result))


if __name__ == "__main__":
  main()
