"""The run config's `reward` section (paper §2): the parts of the reward and the verifiers'
limits. The reward itself is rewards/reward.py."""
from __future__ import annotations

import dataclasses

from magistral_jax.rewards.length import length_penalty

# The languages the language-consistency bonus is paid in by default.
DEFAULT_LANGUAGES = ("en", "fr", "es", "it", "de", "zh", "ru")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  # The soft overlong penalty (paper §2, rewards/length.py): 0 up to l_max - l_cache tokens, then
  # linear down to -length_penalty_max at l_max. Small: l_max - l_cache = 32k.
  l_max: int = 40960
  l_cache: int = 8192             # NOT STATED in the paper
  language_bonus: float = 0.1
  languages: tuple[str, ...] = DEFAULT_LANGUAGES   # the bonus is paid in these (empty: any)
  format_reward: float = 0.1
  correct_reward: float = 0.9
  length_penalty_max: float = 0.1
  num_tests: int = 20
  test_timeout_s: float = 4.0
  memory_mb: int = 300
  compile_timeout_s: float = 10.0
  math_timeout_s: int = 5         # math-verify's own (SIGALRM) timeout, per parse and per verify
  python: str | None = None       # interpreter for sandboxed Python; None: a system python3
  # Run generated code even where no private filesystem (mount namespace) can be made, in a weaker
  # sandbox, with a loud warning (rewards/sandbox.py). Off: such a host refuses to run code.
  allow_weak_sandbox: bool = False
  # The control run of a claim that RL learned (issue #51; spurious rewards lift some models):
  # "random" pays the correctness part on a coin of probability control_rate instead of the
  # verifier's verdict. Set control_rate to the mean accuracy of the run it controls. The coin is
  # drawn per completion from its group seed and text (reproducible, blind to correctness). The
  # verdict itself stays in parts["correct"], so accuracy metrics and evaluation stay true; the
  # coin is in info["control_paid"], and the reward is the sum of the other parts and the coin.
  control: str = "none"           # "none" | "random"
  control_rate: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, "languages", tuple(self.languages))
    if self.control not in ("none", "random"):
      raise ValueError(f"RewardConfig: control must be 'none' or 'random', got {self.control!r}")
    if not 0.0 <= self.control_rate <= 1.0:
      raise ValueError(f"RewardConfig: control_rate must be in [0, 1], got {self.control_rate}")
    try:   # the penalty's own check of the length budget, before any completion is scored
      length_penalty(0, self.l_max, self.l_cache, self.length_penalty_max)
    except ValueError as e:
      raise ValueError(f"RewardConfig: {e}") from None
