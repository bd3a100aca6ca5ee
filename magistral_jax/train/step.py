"""The sharded train step: fp32 gradient accumulation over microbatches, AdamW, a NaN guard.

One call = one optimizer step on one minibatch, given as a stack of packed microbatches
[n_micro, rows, row_len] (rl/collate.py). Each microbatch's loss is already its exact share of the
minibatch loss (the normalisers are global), so gradients are simply summed, in fp32, inside a
`lax.scan` (one compiled microbatch body, whatever n_micro is).

On the trainer mesh, parameters and optimizer moments are FSDP-sharded by the logical-axis rules
(parallel/sharding.py), microbatch rows are split over ('data', 'fsdp'), and the state buffers are
donated. A step whose loss or gradients are not finite is skipped: the state is returned unchanged
except for the `skipped` counter.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from magistral_jax.model import transformer as tfm
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.bulk import LocalRows
from magistral_jax.parallel.sharding import ShardingCtx, logical_sharding, replicated
from magistral_jax.parallel.config import DEFAULT_RULES
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.loss import combine_metrics, empty_metrics, grpo_loss, summarize_metrics

# A loss function maps (params, one microbatch dict, reference params or None) to
# (this microbatch's share of the minibatch loss, additive metric sums incl. 'loss').
LossFn = Callable[[Any, dict, Any], tuple[jax.Array, dict]]

BATCH_AXES = (None, "act_batch", "act_length")   # [n_micro, rows, row_len]


class TrainState(NamedTuple):
  step: jax.Array      # optimizer steps applied
  params: Any          # master weights (ModelConfig.param_dtype: fp32 in the recipes)
  opt_state: Any
  skipped: jax.Array   # steps skipped by the NaN guard


# ---- state ---------------------------------------------------------------------------------------

def state_shardings(model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh, rules=DEFAULT_RULES):
  """TrainState of NamedShardings: params by their logical axes; optimizer moments like the params
  they belong to; counters replicated."""
  p_sh = tfm.params_on(model_cfg, mesh, rules)
  opt_abstract = jax.eval_shape(tx.init, tfm.param_shapes(model_cfg))
  rep = replicated(mesh)
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, opt_abstract, p_sh,
                                 transform_non_params=lambda _: rep)
  return TrainState(rep, p_sh, opt_sh, rep)


def init_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, rng, mesh=None,
               rules=DEFAULT_RULES, params=None) -> TrainState:
  """A fresh TrainState (random params unless `params` is given), created directly in its layout."""
  def make(rng, params):
    if params is None:
      params = tfm.init_params(model_cfg, rng)
    params = jax.tree.map(lambda p: p.astype(model_cfg.jnp_param_dtype), params)
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), jnp.zeros((), jnp.int32))
  if mesh is None:
    return jax.jit(make)(rng, params)
  sh = state_shardings(model_cfg, tx, mesh, rules)
  if params is not None:   # e.g. restored onto one device: lay them out on this mesh first
    params = jax.device_put(params, sh.params)
  return jax.jit(make, out_shardings=sh)(rng, params)


def place_state(state: TrainState, model_cfg: ModelConfig, tx, mesh, rules=DEFAULT_RULES) -> TrainState:
  """Moves an existing TrainState (e.g. restored on one device) onto the trainer layout."""
  return jax.device_put(state, state_shardings(model_cfg, tx, mesh, rules))


def batch_sharding(mesh, rules=DEFAULT_RULES, shape=None):
  """Microbatch stacks: rows over the data-parallel axes."""
  return logical_sharding(BATCH_AXES, mesh, rules, shape)


# ---- the step --------------------------------------------------------------------------------------

def accumulate_gradients(loss_fn: LossFn, params, batch: dict, ref_params=None, param_sh=None):
  """Σ over the microbatches of the stack of ∇loss, accumulated in fp32 by a lax.scan, and the
  combined metric sums. Equals the gradient of the unsplit minibatch (global normalisers)."""
  first = jax.tree.map(lambda x: x[0], batch)
  _, sums_like = jax.eval_shape(loss_fn, params, first, ref_params)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def zeros_f32(p, sh=None):
    z = jnp.zeros(p.shape, jnp.float32)
    return z if sh is None else jax.lax.with_sharding_constraint(z, sh)

  acc0 = (jax.tree.map(zeros_f32, params) if param_sh is None
          else jax.tree.map(zeros_f32, params, param_sh))

  def body(carry, micro):
    g_acc, s_acc = carry
    (_, sums), g = grad_fn(params, micro, ref_params)
    g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
    return (g_acc, combine_metrics(s_acc, sums)), None

  (grads, sums), _ = jax.lax.scan(body, (acc0, empty_metrics(sums_like)), batch)
  return grads, sums


def make_train_step(model_cfg: ModelConfig, tx: optax.GradientTransformation, loss_fn: LossFn,
                    mesh=None, rules=DEFAULT_RULES, summarize: Callable[[dict], dict] | None = None,
                    with_ref: bool = False, donate: bool = True, lr_schedule=None):
  """Returns step(state, batch[, ref_params]) -> (state, metrics), jitted (with in/out shardings
  on `mesh` if given). `batch` is a dict of [n_micro, rows, row_len] arrays."""
  summarize = summarize or (lambda s: dict(s))
  p_sh = None
  if mesh is not None:
    st_sh = state_shardings(model_cfg, tx, mesh, rules)
    p_sh = st_sh.params

  def step(state: TrainState, batch: dict, ref_params=None):
    params = state.params
    grads, sums = accumulate_gradients(loss_fn, params, batch, ref_params, p_sh)

    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, new_opt = tx.update(grads, state.opt_state, params)
    new_params = optax.apply_updates(params, updates)
    applied = TrainState(state.step + 1, new_params, new_opt, state.skipped)
    kept = state._replace(skipped=state.skipped + 1)
    new_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), applied, kept)

    metrics = summarize(sums)
    metrics.update(grad_norm=grad_norm, update_applied=finite.astype(jnp.float32),
                   skipped_steps=new_state.skipped)
    if lr_schedule is not None:
      metrics["learning_rate"] = lr_schedule(state.step)
    return new_state, metrics

  donate_argnums = (0,) if donate else ()
  if mesh is None:
    fn = jax.jit(step, donate_argnums=donate_argnums)
  else:
    b_sh = batch_sharding(mesh, rules)
    in_sh = (st_sh, b_sh) + ((p_sh,) if with_ref else ())
    fn = jax.jit(step, in_shardings=in_sh, out_shardings=(st_sh, replicated(mesh)),
                 donate_argnums=donate_argnums)
  return fn


def shard_batch(batch: dict, mesh=None, rules=DEFAULT_RULES) -> dict:
  """Puts a packed microbatch stack on the trainer devices (rows over the data axes). A field may
  be the whole numpy array or (many processes) this process's LocalRows of it."""
  if mesh is None:
    return jax.tree.map(jnp.asarray, batch)
  sh = batch_sharding(mesh, rules)
  row_axes = sh.spec[1] if len(sh.spec) > 1 else None
  row_axes = () if row_axes is None else (row_axes,) if isinstance(row_axes, str) else row_axes
  dp = 1
  for a in row_axes:
    dp *= mesh.shape[a]
  for k, v in batch.items():
    if v.ndim != 3:
      raise ValueError(f"batch[{k!r}] has shape {v.shape}; expected [n_micro, rows, row_len]")
    if v.shape[1] % dp:
      raise ValueError(f"batch[{k!r}] has {v.shape[1]} rows per microbatch, not a multiple of the "
                       f"trainer's data-parallel size {dp}: set GRPOConfig.microbatch_rows accordingly")
  if sh.is_fully_addressable and not any(isinstance(v, LocalRows) for v in batch.values()):
    return jax.device_put(batch, sh)
  # Many processes: each puts only the rows of its own devices (a follower holds only those:
  # parallel.bulk.LocalRows).
  return {k: jax.make_array_from_callback(v.shape, sh, lambda idx, v=v: v[idx])
          for k, v in batch.items()}


# ---- GRPO --------------------------------------------------------------------------------------

def grpo_loss_fn(model_cfg: ModelConfig, grpo_cfg: GRPOConfig, mesh=None, rules=DEFAULT_RULES,
                 temperature: float = 1.0, compute_entropy: bool = True) -> LossFn:
  """The policy forward on one packed microbatch followed by rl.loss.grpo_loss.

  `temperature` must be the generator's sampling temperature, so π_θ and π_old are the same
  distribution family. The entropy metric comes out of the same chunked log-prob pass."""
  shard = None if mesh is None else ShardingCtx(mesh, tuple(rules))
  with_entropy = compute_entropy or bool(grpo_cfg.entropy_coef)

  def loss_fn(params, m, ref_params=None):
    h = tfm.hidden_states(params, model_cfg, m["tokens"], m["positions"], m["segment_ids"], shard)
    out = tfm.token_logprobs(params, model_cfg, h, m["targets"], temperature, with_entropy)
    lp, ent = out if with_entropy else (out, None)
    ref_lp = None
    if grpo_cfg.kl_coef:
      if ref_params is None:
        raise ValueError("GRPOConfig.kl_coef > 0: the train step needs ref_params (make_train_step(with_ref=True))")
      ref_h = tfm.hidden_states(ref_params, model_cfg, m["tokens"], m["positions"], m["segment_ids"], shard)
      ref_lp = jax.lax.stop_gradient(tfm.token_logprobs(ref_params, model_cfg, ref_h, m["targets"], temperature))
    return grpo_loss(lp, m["old_logprobs"], m["advantages"], m["weights"], m["loss_mask"], grpo_cfg,
                     segment_ids=m["segment_ids"], ref_logprobs=ref_lp, entropy=ent)
  return loss_fn


def make_grpo_step(model_cfg: ModelConfig, grpo_cfg: GRPOConfig, tx, mesh=None, rules=DEFAULT_RULES,
                   temperature: float = 1.0, compute_entropy: bool = True, donate: bool = True,
                   lr_schedule=None):
  """The GRPO train step: step(state, batch) or, with kl_coef > 0, step(state, batch, ref_params)."""
  loss_fn = grpo_loss_fn(model_cfg, grpo_cfg, mesh, rules, temperature, compute_entropy)
  return make_train_step(model_cfg, tx, loss_fn, mesh, rules, summarize_metrics,
                         with_ref=bool(grpo_cfg.kl_coef), donate=donate, lr_schedule=lr_schedule)
