"""Optional adapter: lets the real `google-jetstream` orchestrator drive our Engine.

The package is an extra (`pip install google-jetstream==0.2.2`), not a dependency: it is archived
upstream, pulls in TensorFlow through seqio, and its orchestrator calls `jax.tree_map`, which
current JAX removed. `make_jetstream_engine` therefore
  1. installs `jax.tree_map = jax.tree.map` when the attribute is missing (same semantics: map a
     function over the leaves of one or more trees). This is process-global, so it is done only
     when the adapter is actually used, and never overrides an existing attribute;
  2. imports jetstream lazily and raises an ImportError naming the extra when it is absent;
  3. wraps our Engine in a subclass of `jetstream.engine.engine_api.Engine`.

JetStream's ResultTokens pack [tokens | valid | length] along the last axis of one int array; we
fill it from our ResultTokens ('length' is the slot's sequence length in the cache, prompt
included). Our per-token log-probs ride along as `log_prob` when the installed ResultTokens has
that field. The RL pipeline uses GeneratorLoop, not this adapter: JetStream's orchestrator knows
neither policy versions nor in-flight weight updates.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from magistral_jax.generate.engine import Engine

EXTRA = "google-jetstream==0.2.2"


def _install_tree_map_shim() -> None:
  if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map


def import_engine_api():
  _install_tree_map_shim()
  try:
    from jetstream.engine import engine_api
  except ImportError as e:
    raise ImportError(f"the JetStream adapter needs the optional extra `{EXTRA}` "
                      f"(not installed: {e})") from e
  return engine_api


def make_jetstream_engine(engine: Engine, params: Any, tokenizer_params: Any = None,
                          tokenizer: Any = None, *, temperature: float):
  """A `jetstream.engine.engine_api.Engine` backed by `engine`; `params` are returned by
  load_params (already placed with engine.load_params). JetStream's requests carry no sampling
  temperature, so every request this adapter serves samples at `temperature`."""
  api = import_engine_api()
  has_logprob = "log_prob" in {f.name for f in dataclasses.fields(api.ResultTokens)}

  def pack(tokens, valid, lengths, logprobs):
    data = jnp.stack([tokens.astype(jnp.int32), valid.astype(jnp.int32),
                      lengths.astype(jnp.int32)], axis=-1)
    kw = {"log_prob": logprobs[:, None]} if has_logprob else {}
    return api.ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
                            samples_per_slot=1, **kw)

  class JetStreamEngine(api.Engine):
    def load_params(self, *args, rng=None, **kwargs):
      return engine.load_params(params)

    def init_decode_state(self, *args, **kwargs):
      return engine.init_decode_state()

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length, sampler=None,
                rng=None, **kwargs):
      if sampler is not None:
        raise NotImplementedError("custom samplers: sampling is configured on the Engine")
      key = None if rng is None else jax.random.key_data(rng) if jnp.issubdtype(
          getattr(rng, "dtype", jnp.uint32), jax.dtypes.prng_key) else rng
      prefix = engine.prefill(params, padded_tokens, true_length, temperature=temperature,
                              rng=key, existing_prefix=existing_prefix)
      one = jnp.ones((1,), bool)
      return prefix, pack(prefix.token[None], one, prefix.true_length[None],
                          prefix.logprob[None])

    def insert(self, prefix, decode_state, slot):
      return engine.insert(prefix, decode_state, slot)

    def generate(self, params, decode_state, sampler=None, **kwargs):
      state, res = engine.generate(params, decode_state)
      return state, pack(res.tokens, res.valid, res.lengths, res.logprobs)

    def free_resource(self, slot):
      return None

    def get_prefix_destination_sharding(self):
      return None

    def get_tokenizer(self):
      return tokenizer_params

    def build_tokenizer(self, metadata):
      if tokenizer is None:
        raise NotImplementedError("pass tokenizer= to make_jetstream_engine")
      return tokenizer

    @property
    def max_concurrent_decodes(self):
      return engine.max_concurrent_decodes

    @property
    def samples_per_slot(self):
      return 1

    @property
    def max_prefill_length(self):
      return engine.max_prefill_length

    @property
    def mesh(self):
      return engine.mesh

    @property
    def colocated_cpus(self):
      return None

  return JetStreamEngine()
