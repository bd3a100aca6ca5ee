"""The sandbox as a tool (rewards/tool_run.py): a call's output, or its error, always comes back
as text; hostile calls get the code verifier's containment (the attacks of hostile_programs.py,
run as tool calls, in both private-filesystem modes)."""
import glob
import os
import time

import host_leaks
import hostile_programs as hp
import psutil
import pytest

from magistral_jax.rewards.code_check import default_python
from magistral_jax.rewards.tool_run import run_call
from magistral_jax.tool_use.config import ToolConfig
from magistral_jax.tool_use.protocol import EMPTY_CALL

CFG = ToolConfig(enabled=True, cpu_s=1.0)
PY = default_python()


@pytest.fixture(params=["default", "userns"])
def sbx(request, private_sandbox):
  return private_sandbox(request.param, 244)


def test_an_honest_call_prints_its_result(sbx):
  r = run_call("print(52 - 17 + 8)", CFG, sandbox=sbx, python=PY)
  assert (r.output, r.error) == ("43\n", None)
  r = run_call("import math\nprint(math.factorial(20))", CFG, sandbox=sbx, python=PY)
  assert r.output.strip() == "2432902008176640000"


@pytest.mark.parametrize("source, kind, says", [
    ("1/0", "exception", "ZeroDivisionError: division by zero"),
    ("while True:\n  pass", "time", "ran past its 1 s time limit"),
    ("x = bytearray(10**9)", "memory", "MemoryError"),
    ("while True:\n  print('x' * 1000)", "output", "output limit"),
    ("  \n", "empty", EMPTY_CALL),
])
def test_a_failing_call_returns_its_error_as_text(sbx, source, kind, says):
  r = run_call(source, CFG, sandbox=sbx, python=PY)
  assert r.error == kind and says in r.output, r


def _leftovers():
  found = []
  for d in hp.WRITE_TARGETS:
    found += glob.glob(os.path.join(d, hp.MARK + "*"))
  return [p for p in found if not os.path.basename(p).startswith(hp.MARK + "_planted")]


HOSTILE = sorted(n for n, a in hp.ATTACKS.items()
                 if a.lang == "python" and a.shape == "stdin" and a.kind in (
                     "write", "read", "process", "ipc"))


def test_hostile_calls_are_contained_and_read_nothing(sbx):
  """Every hostile Python program, as a tool call: it returns (an error or some output, never an
  exception of ours), within its time bound, leaves no file, and reads no planted secret."""
  assert {"write", "read_planted", "fork_bomb", "daemon", "memory_hog", "sleep"} <= set(HOSTILE)
  secret = "mj_tool_" + os.urandom(8).hex()
  planted = host_leaks.plant_files(secret)
  try:
    for name in HOSTILE:
      t0 = time.monotonic()
      r = run_call(hp.ATTACKS[name].src, CFG, sandbox=sbx, python=PY)
      assert time.monotonic() - t0 < CFG.cpu_s * 3 + 3 + 5, name   # the sandbox's backstop
      assert secret not in r.output, name
      assert isinstance(r.output, str)
  finally:
    host_leaks.unplant_files(planted)
  assert not _leftovers()
  # Nothing of the slot's uid lives on (the default mode runs calls as that uid).
  assert not [p.pid for p in psutil.process_iter(["uids"])
              if p.info["uids"] and sbx.uid in p.info["uids"]]


def test_gsm8k_tool_traces_hold_what_the_tool_prints(sbx):
  """The cold start's GSM8K traces (data/gsm8k_traces.py, issue #67) show each call's result as
  the tool returns it: a sample of the train split's calculator expressions, run as calls."""
  import json
  import re
  from magistral_jax.data import gsm8k_traces, records
  rows = [json.loads(l) for l in open(records.shipped_path(gsm8k_traces.SHIPPED))]
  exprs = [e for r in rows[::400] for e in re.findall(r"<<([^<>=]*)=", r["solution"])]
  assert len(exprs) >= 40 and any("/" in e for e in exprs)
  for e in exprs:
    r = run_call(f"print({e})", CFG, sandbox=sbx, python=PY)
    assert (r.output, r.error) == (gsm8k_traces.printed(e) + "\n", None), e
