"""Benchmark: can the SFT data loader keep the trainer fed? SftLoader over GSM8K traces
(array_record; SmolLM2 GGUF and Tekken tokenizers), packed into --seq_len rows, against a plain
Python loop over the same JSONL; the trainer, a jitted forward + backward at the tiny and
SmolLM2-135M shapes.

  python bench/data.py [--seq_len 1024]

Last line, one JSON object: loader and baseline examples/s and tokens/s, trainer tokens/s,
loader_over_consumption (goal >= 10).
"""
import json
import os
import sys
import tempfile
import time

import common
import numpy as np

from magistral_jax.data import gsm8k_traces
from magistral_jax.data import loader
from magistral_jax.data import records
from magistral_jax.data import tfds_builders
from magistral_jax.model import tokenizer as tk
from magistral_jax.model.config import SMOLLM2_135M, ModelConfig


def measure_loader(data_dir, tok, seq_len, batch_size, seconds):
  fn = loader.chat_sft_tokenize_fn(tok)
  sft = loader.SftLoader(data_dir, "gsm8k_traces", fn, seq_len=seq_len, batch_size=batch_size,
                         seed=0, shard_index=0, shard_count=1)
  next(sft)                                   # thread start-up and first fill
  n_ex = n_tok = n_batches = 0
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    b = next(sft)
    seg = b["segment_ids"]
    n_ex += sum(len(np.unique(row[row > 0])) for row in seg)
    n_tok += int(np.sum(seg > 0))
    n_batches += 1
  dt = time.perf_counter() - t0
  return {"examples_per_s": n_ex / dt, "tokens_per_s": n_tok / dt, "batches": n_batches,
          "tokens_per_example": n_tok / max(n_ex, 1), "fill": n_tok / (n_batches * batch_size * seq_len)}


def measure_plain_loop(path, tok, seconds):
  fn = loader.chat_sft_tokenize_fn(tok)
  n_ex = n_tok = 0
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    with open(path, encoding="utf-8") as f:
      for line in f:
        n_ex += 1
        n_tok += len(fn(json.loads(line))["tokens"])
        if time.perf_counter() - t0 >= seconds:
          break
  dt = time.perf_counter() - t0
  return {"examples_per_s": n_ex / dt, "tokens_per_s": n_tok / dt}


def measure_trainer(cfg: ModelConfig, seq_len: int, batch_size: int, steps: int):
  import jax
  import jax.numpy as jnp
  from magistral_jax.model import named, transformer
  cfg = cfg.replace(max_position_embeddings=max(seq_len, cfg.max_position_embeddings))
  params = named.random_params(cfg)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch_size, seq_len)), jnp.int32)
  # Packed rows of 4 sequences each, as the loader emits.
  seg = jnp.asarray(np.repeat(np.arange(1, 5), seq_len // 4)[None].repeat(batch_size, 0), jnp.int32)
  pos = jnp.asarray(np.tile(np.arange(seq_len // 4), 4)[None].repeat(batch_size, 0), jnp.int32)
  mask = jnp.ones((batch_size, seq_len), jnp.float32)

  def loss_fn(p, tokens, pos, seg, mask):
    h = transformer.hidden_states(p, cfg, tokens[:, :-1], pos[:, :-1], seg[:, :-1])
    lp = transformer.token_logprobs(p, cfg, h, tokens[:, 1:])
    m = mask[:, 1:] * (seg[:, 1:] == seg[:, :-1])
    return -jnp.sum(lp * m) / jnp.sum(m)

  step = jax.jit(jax.value_and_grad(loss_fn))
  t = common.time_fn(lambda: step(params, tokens, pos, seg, mask), steps)
  return {"step_s": t.median, "tokens_per_s": batch_size * seq_len / t.median,
          "compile_s": t.warmup[0], "params": cfg.num_params(), "batch": [batch_size, seq_len],
          "device": str(jax.devices()[0].platform)}


def main():
  args = common.argument_parser(
      __doc__, seq_len=512, loader_batch=8, loader_seconds=5.0, tiny_batch=8, smollm2_batch=1,
      steps=3, configs="tiny,smollm2").parse_args()

  result = {"seq_len": args.seq_len, "loader": {}, "plain_loop_baseline": {}, "trainer": {}}
  toks = {}
  try:
    toks["smollm2_gguf"] = tk.HFTokenizer.from_gguf()
  except Exception as e:  # noqa: BLE001  report, and measure with the other one
    print(f"SmolLM2 GGUF tokenizer unavailable: {e}", file=sys.stderr)
  toks["tekken"] = tk.MistralCommonTokenizer("tekken_240911.json")
  with tempfile.TemporaryDirectory() as d:
    # The test split as the cold-start recipe's traces (data/gsm8k_traces.py).
    path = os.path.join(d, f"{gsm8k_traces.NAME}.jsonl")
    gsm8k_traces.write_traces(path, source_path=records.shipped_path("gsm8k_test"),
                              source="gsm8k_test")
    tfds_builders.build_dataset("sft", gsm8k_traces.NAME, path, d)
    for name, tok in toks.items():
      result["loader"][name] = measure_loader(d, tok, args.seq_len, args.loader_batch, args.loader_seconds)
      result["plain_loop_baseline"][name] = measure_plain_loop(path, tok, args.loader_seconds)
      print(name, json.dumps(result["loader"][name]), json.dumps(result["plain_loop_baseline"][name]),
            flush=True)

  shapes = {"tiny": ("tiny", ModelConfig(), args.tiny_batch),
            "smollm2": ("smollm2_135m", SMOLLM2_135M, args.smollm2_batch)}
  for c in args.configs.split(","):
    name, cfg, b = shapes[c]
    result["trainer"][name] = measure_trainer(cfg, args.seq_len, b, args.steps)
    print(name, json.dumps(result["trainer"][name]), flush=True)

  # The loader measured with the SmolLM2 tokenizer (the shipped model's) when available.
  ref = result["loader"].get("smollm2_gguf") or result["loader"]["tekken"]
  for tr in result["trainer"].values():   # examples/s the trainer eats
    tr["examples_per_s"] = tr["tokens_per_s"] / ref["tokens_per_example"]
  ratios = {k: ref["examples_per_s"] / tr["examples_per_s"] for k, tr in result["trainer"].items()}
  result.update(ratio_per_config=ratios, loader_over_consumption=min(ratios.values()),
                goal=">= 10")
  common.emit(result)


if __name__ == "__main__":
  main()
