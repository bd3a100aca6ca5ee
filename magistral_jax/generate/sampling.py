"""Token sampling and the sampled token's log-prob.

Which distribution the log-prob is under
----------------------------------------
Every sampled token carries  log π_T(y | ·) = log_softmax(logits / T)[y]  in float32, where T is
the sampling temperature and `logits` is `transformer.logits(params, cfg, hidden)`. This is the
*untruncated* tempered policy: top-p / top-k only decide which token is drawn, they do not
renormalise the log-prob. It is the quantity the trainer computes as π_θ with
`transformer.token_logprobs(..., temperature=T)` (same logits formula, fp32, divide by T, subtract
the logsumexp, no truncation; the trainer may sum its logsumexp over vocab pieces, which agrees to
fp32 rounding), so the GRPO ratio π_θ / π_old compares like with like. With
`greedy=True` the argmax is taken and the log-prob is still log π_T of that token.

Sampling is per slot: each slot has its own PRNG key, and the key for a token is
fold_in(slot_key, position). A sample is therefore the same whether it ran alone or batched with
others, and whichever slot it landed in.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How tokens are drawn. Static per engine (part of the compiled decode step).

  temperature: divides the logits (also defines the log-prob reported, see module doc).
  top_p: nucleus mass kept (1.0 = off). top_k: keep the k most likely tokens (0 = off).
  greedy: argmax instead of sampling. max_new_tokens: default cap per completion.
  stop_strings: stop once the detokenized completion contains one (host-side check).
  eos_id: stop token (None = never stop on a token)."""
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  greedy: bool = False
  max_new_tokens: int = 256
  stop_strings: tuple[str, ...] = ()
  eos_id: int | None = None

  def __post_init__(self):
    if not self.temperature > 0:
      raise ValueError(f"SamplingConfig.temperature must be > 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"SamplingConfig.top_k must be >= 0, got {self.top_k}")
    if self.max_new_tokens < 1:
      raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
    object.__setattr__(self, "stop_strings", tuple(self.stop_strings))


def tempered_logprobs(logits: Array, temperature: float) -> Array:
  """log_softmax(logits / T) in float32, written as token_logprobs writes it (lg/T - lse)."""
  lg = logits.astype(jnp.float32) / temperature
  return lg - jax.nn.logsumexp(lg, axis=-1, keepdims=True)


def token_logprob(logits: Array, tokens: Array, temperature: float) -> Array:
  """log π_T(tokens) for logits [..., V] and tokens [...]: the π_old the loss uses."""
  lg = logits.astype(jnp.float32) / temperature
  lse = jax.nn.logsumexp(lg, axis=-1)
  return jnp.take_along_axis(lg, tokens[..., None], axis=-1)[..., 0] - lse


def _truncate(lg: Array, top_k: int, top_p: float) -> Array:
  """Masks (to -inf) tokens outside the top-k and outside the smallest top-p nucleus."""
  if top_k == 0 and top_p >= 1.0:
    return lg
  v = lg.shape[-1]
  k = v if top_k == 0 else min(top_k, v)
  top_vals, _ = jax.lax.top_k(lg, k)  # sorted descending, [..., k]
  threshold = top_vals[..., -1:]
  if top_p < 1.0:
    probs = jax.nn.softmax(top_vals, axis=-1)
    # Keep a token while the mass of the strictly-more-likely tokens is < top_p (always keeps
    # the first); the threshold is the smallest kept logit.
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = before < top_p
    threshold = jnp.min(jnp.where(kept, top_vals, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(lg >= threshold, lg, -jnp.inf)


def sample(logits: Array, keys: Array, positions: Array, cfg: SamplingConfig):
  """Draws one token per row. logits [B, V] (any float dtype), keys [B] typed PRNG keys,
  positions [B] (folded into the key). Returns (tokens [B] int32, logprobs [B] fp32)."""
  lg = logits.astype(jnp.float32) / cfg.temperature
  if cfg.greedy:
    tokens = jnp.argmax(lg, axis=-1)
  else:
    masked = _truncate(lg, cfg.top_k, cfg.top_p)
    step_keys = jax.vmap(jax.random.fold_in)(keys, positions)
    tokens = jax.vmap(jax.random.categorical)(step_keys, masked)
  tokens = tokens.astype(jnp.int32)
  return tokens, token_logprob(logits, tokens, cfg.temperature)
