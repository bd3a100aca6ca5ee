"""tools/heldout_exposure.py on the recorded H100 learning run (docs/results): the streams before
the evaluation bucket are regenerated as that run consumed them, and its held-out problems split
by exposure (issue #63's re-analysis)."""
import os
import subprocess
import sys
import json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_recorded_h100_run_trained_on_52_of_its_256_heldout_problems():
  out = subprocess.run(
      [sys.executable, "tools/heldout_exposure.py", "docs/results/learn_h100_32batches.tar.gz",
       "--task=synthetic/20/1-3", "--sft_pairs=0"], cwd=ROOT, capture_output=True, text=True,
      check=True).stdout
  res = json.loads(out.strip().splitlines()[-1])
  rl = res["rl"]
  assert rl["rl_prompts"] == 1663 and rl["trained_on"] == 52 and rl["in_sft"] == 0
  assert rl["never_trained"]["n"] == 204
  assert round(rl["never_trained"]["before"], 3) == 0.066
  assert round(rl["never_trained"]["after"], 3) == 0.186
  assert rl["all"]["n"] == 256 and round(rl["all"]["gain"], 3) == 0.188   # what was reported
  assert res["control"]["never_trained"]["ci_high"] < 0
