"""The run config's `data` section: where the RL stream and the held-out problems come from
(data/prompts.py), and the synthetic task's knobs (data/synthetic.py)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """source: the RL stream ("synthetic", a dataset name, or several joined by "+"; the filtered
  sets live in data_dir). The held-out evaluation set is the first `heldout` problems of a seeded
  epoch of heldout_source (e.g. "gsm8k_test" for a run that trains on "gsm8k_train"), or of
  source itself when heldout_source is "" (the stream then skips them). A held-out set that
  shares a problem with the stream (id or question text) stops the run.

  The synthetic task (data/synthetic.py): min_steps..max_steps operations on operands up to
  max_operand; its SFT traces slip (a wrong step, then a correction) or ramble (past the row)
  at these rates, and call the interpreter (issue #67: synthetic.tool_trace) at sft_tool_rate."""
  source: str = "synthetic"
  heldout_source: str = ""
  data_dir: str = ""
  min_steps: int = 1
  max_steps: int = 3
  max_operand: int = 20
  allow_negative: bool = True
  heldout: int = 64
  sft_slip_rate: float = 0.0
  sft_ramble_rate: float = 0.0
  sft_tool_rate: float = 0.0

  def __post_init__(self):
    if not 1 <= self.min_steps <= self.max_steps or self.max_operand < 1:
      raise ValueError(f"data: need 1 <= min_steps <= max_steps and max_operand >= 1, got "
                       f"min_steps={self.min_steps} max_steps={self.max_steps} "
                       f"max_operand={self.max_operand}")
    if self.heldout < 0:
      raise ValueError(f"data.heldout={self.heldout} must be >= 0")
    for f in ("sft_slip_rate", "sft_ramble_rate", "sft_tool_rate"):
      if not 0.0 <= getattr(self, f) <= 1.0:
        raise ValueError(f"data.{f}={getattr(self, f)} must be in [0, 1]")
