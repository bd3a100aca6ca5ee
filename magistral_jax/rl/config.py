"""GRPO configuration: the paper's knobs (paper §1, §4, §5) under the paper's names.

Every field the paper does not state is marked NOT STATED with the default we picked.
"""
from __future__ import annotations

import dataclasses

ADV_NORMS = ("minibatch", "group", "none")
LOSS_AGGS = ("token", "sequence", "group_token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
LENGTH_ONLY_GROUPS = ("keep", "drop")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """The GRPO variant of Magistral (paper §1):

      J(θ) = E[ 1/Σ_i|o_i| · Σ_i Σ_t min(ρ_it·Â_it, clip(ρ_it, 1-eps_low, 1+eps_high)·Â_it) ]
      ρ_it = π_θ(o_it | q, o_i,<t) / π_old(o_it | q, o_i,<t)
  """
  # Clipping. eps_low: NOT STATED in the paper (0.2, the PPO/DAPO default). eps_high: 0.26-0.28
  # for Medium, 0.3 for Small.
  eps_low: float = 0.2
  eps_high: float = 0.28
  # Dual clip (Ye et al. 2020) for Â < 0: the objective is floored at dual_clip_c·Â, so a token
  # whose ratio ran far above 1 cannot push an unbounded negative update. None = off (paper: off).
  dual_clip_c: float | None = None
  # Truncated importance weight: a token's effective weight ρ is capped at stale_weight_cap (its
  # gradient is rescaled by sg(min(ρ, cap)/ρ), IMPALA-style), which bounds the influence of tokens
  # sampled by much older policy versions in the async pipeline. None = off (paper: off).
  stale_weight_cap: float | None = None
  # Advantage: Â_i = r_i − mean(r_group), then normalised per `adv_norm`:
  #   minibatch: (Â − mean_mb(Â)) / std_mb(Â)   (paper default; statistics over sequences)
  #   group:     Â / std_group(r)                (classic GRPO)
  #   none:      Â
  adv_norm: str = "minibatch"
  adv_eps: float = 1e-6
  # Loss aggregation: token = Σ over every token of the minibatch / total token count (DAPO, paper);
  # sequence = mean over sequences of per-sequence token means (original GRPO);
  # group_token_sum = mean over groups of (Σ_i Σ_t ·) / Σ_i|o_i| (paper §1's formula read literally).
  loss_agg: str = "token"
  # KL to a reference policy (paper: none, β = 0). The estimator (k1|k2|k3) sets the *value* that
  # is added and logged; the gradient is always the correct sequence-level KL gradient (rl/loss.py).
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  # Entropy bonus (paper: tried, unstable, dropped). 0 = off.
  entropy_coef: float = 0.0
  # Groups (paper §1): groups whose rewards are all equal are dropped. Groups whose rewards differ
  # *only* through the continuous length penalty: NOT STATED. 'keep' (default) is the literal
  # reading (their advantage is not zero, and it is a real signal against overlong answers);
  # 'drop' treats them like zero-advantage groups. Note adv_norm='group' rescales such a group's
  # tiny length-only differences to unit size; pair it with 'drop' if that is not wanted.
  length_only_groups: str = "keep"
  reward_atol: float = 1e-6
  # Multi-turn samples (issue #67, tool calls): one with a void turn (SimpleTIR: a turn after a
  # tool's result with neither a complete call nor an answer) stays in its group's mean but is
  # trained on nothing: no loss, no normaliser weight. Not in the paper (single-turn); a sample
  # without tool results is never dropped by it.
  drop_void_turns: bool = True
  # Batching (paper §4, §5): n_batch completions per step, minibatches of n_mini completions, one
  # optimizer step each (n_batch/n_mini steps; n_batch = n_mini is the paper's best); group_size
  # G completions per prompt (NOT STATED), at least 2, and a group never straddles minibatches.
  n_batch: int = 64
  n_mini: int = 64
  group_size: int = 8
  # Microbatches: a fixed token budget microbatch_tokens = microbatch_rows × row length. Rows are
  # the packing bins of greedy collation; microbatch_rows must be a multiple of the trainer's
  # data-parallel size so every device gets whole rows (4: the default trainer's 4 fsdp devices).
  # A sequence is never split across rows, so a row must hold the longest sequence the
  # generators can return (check_row_fits).
  microbatch_tokens: int = 8192
  microbatch_rows: int = 4

  def __post_init__(self):
    def _choice(name, options):
      v = getattr(self, name)
      if v not in options:
        raise ValueError(f"GRPOConfig.{name}={v!r}; expected one of {options}")
    _choice("adv_norm", ADV_NORMS)
    _choice("loss_agg", LOSS_AGGS)
    _choice("kl_estimator", KL_ESTIMATORS)
    _choice("length_only_groups", LENGTH_ONLY_GROUPS)
    if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
      raise ValueError(f"GRPOConfig: need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
    if self.dual_clip_c is not None and self.dual_clip_c <= 1:
      raise ValueError(f"GRPOConfig.dual_clip_c must be > 1 (or None), got {self.dual_clip_c}")
    if self.stale_weight_cap is not None and self.stale_weight_cap <= 0:
      raise ValueError(f"GRPOConfig.stale_weight_cap must be > 0 (or None), got {self.stale_weight_cap}")
    if min(self.n_batch, self.n_mini, self.group_size, self.microbatch_rows, self.microbatch_tokens) <= 0:
      raise ValueError(f"GRPOConfig: n_batch, n_mini, group_size, microbatch_rows, microbatch_tokens "
                       f"must be positive: {self}")
    if self.n_batch % self.n_mini:
      raise ValueError(f"GRPOConfig: n_batch={self.n_batch} is not a multiple of n_mini={self.n_mini}")
    if self.group_size < 2:
      raise ValueError(f"GRPOConfig.group_size={self.group_size}: GRPO needs at least 2 completions "
                       "per prompt")
    if self.n_mini % self.group_size:
      raise ValueError(f"GRPOConfig: n_mini={self.n_mini} is not a multiple of group_size="
                       f"{self.group_size} (a group never straddles minibatches)")
    if self.microbatch_tokens % self.microbatch_rows:
      raise ValueError(f"GRPOConfig: microbatch_tokens={self.microbatch_tokens} is not a multiple of "
                       f"microbatch_rows={self.microbatch_rows}")

  @property
  def row_len(self) -> int:
    return self.microbatch_tokens // self.microbatch_rows

  def check_row_fits(self, max_prompt_tokens: int, max_new_tokens: int) -> None:
    """Raises unless the longest sequence, a prompt of max_prompt_tokens (engine.max_prefill_length)
    and max_new_tokens completion tokens (sampling.max_new_tokens), packs into one row: greedy
    collation (rl/collate.py first_fit) cannot place a longer one, and that would stop the run
    at its first long completion."""
    longest = max_prompt_tokens + max_new_tokens - 1   # collate.Completion.num_tokens
    if longest > self.row_len:
      raise ValueError(
          f"the longest sequence, engine.max_prefill_length={max_prompt_tokens} prompt tokens + "
          f"sampling.max_new_tokens={max_new_tokens} - 1 = {longest} packed tokens, does not fit "
          f"a microbatch row of rl.microbatch_tokens={self.microbatch_tokens} / "
          f"rl.microbatch_rows={self.microbatch_rows} = {self.row_len} tokens: raise "
          f"rl.microbatch_tokens to at least {self.microbatch_rows * longest} "
          f"(rl.microbatch_rows x {longest}), lower rl.microbatch_rows, or lower "
          f"engine.max_prefill_length or sampling.max_new_tokens")

  @property
  def num_minibatches(self) -> int:
    return self.n_batch // self.n_mini

  def replace(self, **kw) -> "GRPOConfig":
    return dataclasses.replace(self, **kw)
