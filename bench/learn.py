"""A real model learns (issue #51): SmolLM2-135M-Instruct, cold-start SFT -> headroom table ->
GRPO on the chosen task -> held-out gain with a paired-bootstrap CI, against a random-reward
control from the same weights. Each phase is a launcher, resumable on the same --workdir.

  python bench/learn.py --workdir=runs/learn
  bash bench/gpu_suite.sh learn                          # one H100 (--gpu)
  python bench/learn.py --gpu --shrink --workdir=/tmp/l  # the GPU command shrunk, on CPU
  python bench/learn.py --tools --workdir=runs/learn_tools  # issue #67: with the interpreter
  python bench/learn.py --tools --gsm8k --gpu --workdir=runs/learn_gsm8k_tools   # on GSM8K

--tools (issue #67): configs/smollm2_learn.py's `tools` recipe (a cold start that calls the
interpreter in some traces, on a task the model fails at without it), GRPO and the control as
above, then the same recipe without the tool (its own cold start and RL, the same lengths and
held-out problems): the tool recipe's end against it, paired by problem.

--tools --gsm8k: what the tool does on GSM8K (`gsm8k_tool`): two cold starts on GSM8K's train
split, one whose traces call the interpreter for the solutions' calculator annotations
(configs/smollm2.py `tools`), one without, each evaluated on the same never-trained problems of
the test split, paired by problem.

Last line: one JSON object.
"""
import json
import os
import signal
import sys
import tarfile
import time

import common   # bench/common.py, beside the script
from common import read_json   # noqa: F401  (tests/bench/test_learn.py reads learn.read_json)

from magistral_jax.analysis.report import load_heldout_curve as curve, load_run_metrics
from magistral_jax.eval.paired import compare_evals

HEADROOM_SETS = "gsm8k_test,math500,synthetic/20/1-3,synthetic/99/2-3,synthetic/999/2-4"
# headroom_max_new 256: the learn recipe's evaluation length, so both compile one engine (XLA's).
GPU_HEADROOM = dict(headroom_sets=HEADROOM_SETS, headroom_k=16, headroom_problems=64,
                    headroom_max_new=256)
# 2 CPU cores: the synthetic sets only, fewer and shorter samples (GSM8K's ~130-token answers
# x 16 samples x 64 problems would take an hour here).
CPU_HEADROOM = dict(headroom_sets="synthetic/20/1-3,synthetic/99/2-3", headroom_k=8,
                    headroom_problems=32, headroom_max_new=64)

# --shrink: every phase's sizes divided down to seconds on 2 CPU cores, every other knob kept.
SHRINK = {
    # The synthetic task's ~20-token traces in place of GSM8K's ~110: a few steps teach the format,
    # so the shrunk RL runs (32 new tokens) close it and their groups carry advantages.
    "sft": ["--config.data.source=synthetic", "--config.sft.num_steps=6",
            "--config.sft.batch_size=4", "--config.sft.rows_per_micro=4",
            "--config.sft.row_len=320", "--config.sft.learning_rate=3e-4"],
    "eval": ["--config.eval.max_new_tokens=32", "--config.engine.max_concurrent_decodes=8",
             "--num_problems=2", "--config.eval.k=2"],
    "rl": ["--config.rl.n_batch=4", "--config.rl.n_mini=4", "--config.rl.group_size=2",
           "--config.rl.microbatch_tokens=2304", "--config.rl.microbatch_rows=4",
           "--config.sampling.max_new_tokens=32", "--config.reward.l_max=32",
           "--config.reward.l_cache=8", "--config.eval.max_new_tokens=32", "--config.eval.k=2",
           "--config.eval.every=1", "--config.data.heldout=3",
           "--config.engine.max_concurrent_decodes=8", "--config.checkpoint.async_save=False",
           "--config.num_batches=2"],
}
# With --tools: a call and its result do not fit 32 new tokens (every sample was cut, every group
# dropped), so the shrunk runs keep the CPU tool recipe's 96, and the cold start its 12 steps.
SHRINK_TOOLS = {"sft": ["--config.sft.num_steps=12"],
                "rl": ["--config.sampling.max_new_tokens=96", "--config.reward.l_max=96",
                       "--config.reward.l_cache=24", "--config.eval.max_new_tokens=96",
                       "--config.rl.microbatch_tokens=2432"]}   # 4 rows of 512 + 96


def choose_task(headroom: dict, lo: float = 0.1, hi: float = 0.6) -> str | None:
  """The synthetic set with pass@1 in [lo, hi] and the most headroom (pass@k - pass@1): where RL,
  which mostly turns pass@k into pass@1, has the most to gain; failing that, the one with the most
  headroom. None when no synthetic set has any."""
  sets = [(r["headroom"], name, r["pass@1"]) for name, r in headroom["sets"].items()
          if name.startswith("synthetic/")]
  fits = [s for s in sets if lo <= s[2] <= hi]
  # None in the band: the one with the most headroom all the same, if it has any.
  fits = fits or [s for s in sets if s[0] > 0]
  return max(fits)[1] if fits else None


def mean_accuracy(workdir: str) -> float:
  """The mean training accuracy (the verifier's verdicts) over a run's RL batches."""
  vals = [r["accuracy"] for r in load_run_metrics(workdir)[1] if "accuracy" in r]
  if not vals:
    raise RuntimeError(f"{workdir}/metrics.jsonl holds no RL batch's accuracy")
  return sum(vals) / len(vals)


def gain_line(label: str, g: dict) -> str:
  return (f"{label} {100 * g['gain']:+.1f} points [{100 * g['ci_low']:+.1f}, "
          f"{100 * g['ci_high']:+.1f}] ({g['before']:.3f} -> {g['after']:.3f})")


def plot(out_png: str, runs: dict, before: dict) -> str | None:
  """analysis/plots.learning_curves of the runs, saved as out_png (None without matplotlib)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
  except ImportError:
    return None
  from magistral_jax.analysis.plots import learning_curves
  fig = learning_curves(runs, before=before["pass@1"])
  fig.axes[0].set_title(f"held-out pass@1 (k={before['k']}, {before['num_problems']} problems)")
  fig.savefig(out_png, dpi=80)
  return out_png


# What comes back from a device machine (a few files): each run's metrics, evaluations (with the
# per-problem counts) and learning curve, the SFT summary and every phase's log, in one archive.
KEEP = ("metrics.jsonl", "heldout_curve.jsonl", "summary.json", "sft_summary.json", ".log",
        "trained_on.json")


def pack(wd: str, path: str) -> str:
  with tarfile.open(path, "w:gz") as tar:
    for base, _, files in os.walk(wd):
      if "checkpoints" in base or "params" in base or "/data" in base:
        continue
      for f in files:
        if f.endswith(KEEP) or (f.startswith("eval_") and f.endswith(".json")):
          full = os.path.join(base, f)
          tar.add(full, arcname=os.path.relpath(full, wd))
  return path


def main():
  p = common.argument_parser(
      __doc__, workdir="runs/learn", gpu=(False, "the configs' `gpu,colocated` sizes"),
      shrink=(False, "sizes divided down to seconds (rehearsal)"),
      task=("", "synthetic/OPERAND/STEPS; default: from the headroom"),
      headroom_sets=(str, "default: HEADROOM_SETS (CPU: fewer)"),
      headroom_problems=(int, "default 64 (CPU: 32)"), headroom_k=(int, "default 16 (CPU: 8)"),
      headroom_max_new=(int, "default 256 (CPU: 64)"), batches=(0, "RL batches (0: the recipe's)"),
      sft_steps=(0, "SFT steps (0: the recipe's epoch)"),
      skip=("", "phases to skip, comma-separated (headroom, notool)"),
      tools=(False, "issue #67: the tool recipe, its control and the recipe without the tool"),
      gsm8k=(False, "with --tools: GSM8K cold starts with and without the tool, evaluated"),
      gsm8k_problems=(128, "with --gsm8k: GSM8K test problems evaluated"),
      timeout_s=(3600.0, "per phase"),
      out=(os.environ.get("OUT", ""), "where the report goes"))
  p.add_argument("--rl_flag", action="append", default=[], help="a flag for both RL runs")
  a = p.parse_args()
  for key, value in (GPU_HEADROOM if a.gpu else CPU_HEADROOM).items():
    if getattr(a, key) is None:
      setattr(a, key, value)
  wd = os.path.abspath(a.workdir)
  out = os.path.abspath(a.out or wd)
  logs = os.path.join(wd, "logs")
  os.makedirs(out, exist_ok=True)
  os.makedirs(logs, exist_ok=True)
  # A time limit's SIGTERM (gpu_suite.sh's `timeout`) still packs what the phases left.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench/learn.py: stopped by SIGTERM"))
  try:
    summary = run_all(a, wd, out, logs)
  finally:
    pack(wd, os.path.join(out, "learn_runs.tar.gz"))
  print(json.dumps({k: v for k, v in summary.items() if not k.startswith("curve")}))


def run_all(a, wd, out, logs) -> dict:
  """The phases in order; out/learn.json is rewritten after each, so a time limit leaves what was
  measured before it."""
  # One device either way: on 2 CPU cores the generator and the trainer would fight for them.
  sizes = ",gpu,colocated" if a.gpu else ",colocated"
  shrink = ({k: v + (SHRINK_TOOLS.get(k, []) if a.tools else []) for k, v in SHRINK.items()}
            if a.shrink else {})   # later flags win
  t0, walls = time.time(), {}
  summary = {"bench": "learn", "model": "SmolLM2-135M-Instruct", "gpu": a.gpu,
             "shrink": a.shrink, "walls_s": walls}

  def report(**kw):
    summary.update(kw, wall_s=time.time() - t0)
    with open(os.path.join(out, "learn.json"), "w") as f:
      json.dump(summary, f, indent=1)

  def phase(name, argv, done):
    """One launcher, skipped where its `done` file exists; returns that file's JSON."""
    walls[name] = common.run_phase(name, argv, logs, a.timeout_s, done)
    return read_json(done)

  sft_args = shrink.get("sft", []) + ([f"--config.sft.num_steps={a.sft_steps}"]
                                       if a.sft_steps else [])
  if a.tools and a.gsm8k:
    report(**gsm8k_tool(a, wd, sizes, phase))
    return summary
  sft_dir = os.path.join(wd, "sft")
  # GPU: the GSM8K cold start; CPU, and with the tool: the task's own worked traces
  # (configs/smollm2_learn.py `sft`).
  tools = ",tools" if a.tools else ""
  sft_cfg = (f"configs/smollm2.py:sft{sizes}" if a.gpu and not a.tools else
             f"configs/smollm2_learn.py:sft{tools}{',task=' + a.task if a.task else ''}{sizes}")
  report(sft=phase("sft", ["launch/sft.py", f"--config={sft_cfg}", f"--workdir={sft_dir}"]
                   + sft_args, os.path.join(sft_dir, "sft_summary.json")))
  init = f"init={os.path.join(sft_dir, 'params')}"
  headroom = None
  if "headroom" not in a.skip and not a.tools:   # the tool recipe's task is fixed
    hd = os.path.join(wd, "headroom")
    headroom = phase(
        "headroom", ["launch/eval.py",
                     f"--config=configs/{'smollm2' if a.gpu else 'smollm2_learn'}.py:{init}{sizes}",
                     "--checkpoint=init", f"--sets={a.headroom_sets}",
                     f"--num_problems={a.headroom_problems}", f"--workdir={hd}",
                     f"--config.eval.k={a.headroom_k}",
                     f"--config.eval.max_new_tokens={a.headroom_max_new}",
                     f"--config.engine.max_concurrent_decodes={256 if a.gpu else 64}"]
        + shrink.get("eval", []), os.path.join(hd, "eval_init.json"))
    report(headroom={name: {k: r[k] for k in ("pass@1", "headroom", "format_rate", "pass_at",
                                              "num_problems", "response_length_mean", "k")}
                     for name, r in headroom["sets"].items()})
  task = a.task or (choose_task(headroom) if headroom else None) or ""
  print(f"== task: {task or 'the recipe default'}", flush=True)
  learn = (f"--config=configs/smollm2_learn.py:{init}{tools}{',task=' + task if task else ''}"
           f"{sizes}")
  more = (shrink.get("rl", []) + ([f"--config.num_batches={a.batches}"] if a.batches else [])
          + a.rl_flag)
  rl_dir, ctl_dir = os.path.join(wd, "rl"), os.path.join(wd, "control")
  after = phase("rl", ["launch/train.py", learn, f"--workdir={rl_dir}"] + more,
                os.path.join(rl_dir, "eval_after.json"))
  before = read_json(os.path.join(rl_dir, "eval_before.json"))
  gain = compare_evals(before["rows"], after["rows"])
  rate = mean_accuracy(rl_dir)
  report(task=task or "default", heldout_problems=gain["n"], k=before["k"], gain=gain,
         control_rate=rate, format_before=before["format_rate"],
         format_after=after["format_rate"], length_before=before["response_length_mean"],
         length_after=after["response_length_mean"], curve_rl=curve(rl_dir),
         **({"tool_calls_before": before["tool_calls_mean"],
             "tool_calls_after": after["tool_calls_mean"]} if a.tools else {}))
  print(gain_line("gain", gain), flush=True)
  ctl = phase("control", ["launch/train.py",
                          learn.replace("smollm2_learn.py:", "smollm2_learn.py:control,"),
                          f"--workdir={ctl_dir}", f"--config.reward.control_rate={rate:.6f}"]
              + more, os.path.join(ctl_dir, "eval_after.json"))
  control = compare_evals(before["rows"], ctl["rows"])
  # What the verdict did beyond what training on a coin did: the two ends, paired by problem.
  over_control = compare_evals(ctl["rows"], after["rows"])
  report(control=control, over_control=over_control, format_control=ctl["format_rate"],
         curve_control=curve(ctl_dir),
         **({"tool_calls_control": ctl["tool_calls_mean"]} if a.tools else {}))
  print(gain_line("control", control), flush=True)
  print(gain_line("rl over control", over_control), flush=True)
  runs = {"rl": rl_dir, "control (random reward)": ctl_dir}
  if a.tools and "notool" not in a.skip:
    report(**without_tool(a, wd, sizes, sft_args, more, phase, after))
    runs["the same recipe without the tool"] = os.path.join(wd, "rl_notool")
  report(plot=plot(os.path.join(out, "learn.png"), runs, before))
  return summary


def without_tool(a, wd, sizes, sft_args, more, phase, after) -> dict:
  """The tool recipe's baseline (issue #67): the same recipe, cold start and RL, without the
  tool (configs/smollm2_learn.py with the tool recipe's task and lengths, tools off), and the
  tool recipe's end against its end, paired over the same held-out problems."""
  recipes = recipe("smollm2_learn")
  new_tokens = recipes.get_config("tools" + sizes).sampling.max_new_tokens
  plain = f"task={a.task or recipes.TOOLS_TASK},new_tokens={new_tokens}{sizes}"
  sft_dir, rl_dir = os.path.join(wd, "sft_notool"), os.path.join(wd, "rl_notool")
  phase("sft_notool", ["launch/sft.py", f"--config=configs/smollm2_learn.py:sft,{plain}",
                       f"--workdir={sft_dir}"] + sft_args, os.path.join(sft_dir, "sft_summary.json"))
  init = f"init={os.path.join(sft_dir, 'params')}"
  plain_after = phase("rl_notool", ["launch/train.py",
                                    f"--config=configs/smollm2_learn.py:{init},{plain}",
                                    f"--workdir={rl_dir}"] + more,
                      os.path.join(rl_dir, "eval_after.json"))
  plain_before = read_json(os.path.join(rl_dir, "eval_before.json"))
  over = compare_evals(plain_after["rows"], after["rows"])
  print(gain_line("tool recipe over the recipe without it:", over), flush=True)
  return {"over_no_tool": over, "no_tool_before": plain_before["pass@1"],
          "no_tool_after": plain_after["pass@1"], "curve_no_tool": curve(rl_dir)}


# --shrink with --gsm8k: the GSM8K cold starts cut to seconds (their traces kept: the point is the
# tool's calls in them), the evaluations to a few problems with room for a call and its result.
SHRINK_GSM8K = {"sft": ["--config.sft.num_steps=2", "--config.sft.batch_size=4",
                        "--config.sft.rows_per_micro=4"],
                "eval": ["--config.eval.k=1", "--config.eval.max_new_tokens=64",
                         "--config.engine.max_concurrent_decodes=8"]}


def gsm8k_tool(a, wd, sizes, phase) -> dict:
  """What the tool does on GSM8K's held-out problems (issue #67): the cold start whose traces call
  the interpreter for GSM8K's calculator annotations (configs/smollm2.py `tools`, every trace
  that computes) against the same cold start on the plain traces; each evaluated on the same
  `--gsm8k_problems` of the test split (never trained on: launch/eval.py checks), the first with
  the interpreter. Both evaluations decode up to the tool recipe's budget."""
  shrink = SHRINK_GSM8K if a.shrink else {}
  sft_args = ([f"--config.sft.num_steps={a.sft_steps}"] if a.sft_steps else []) + shrink.get(
      "sft", [])
  budget = recipe("smollm2").get_config("tools" + sizes).eval.max_new_tokens
  evals = {}
  for arm, switch in (("tool", "tools,"), ("plain", "")):
    sft_dir, ev = os.path.join(wd, f"sft_{arm}"), os.path.join(wd, f"eval_{arm}")
    phase(f"sft_{arm}", ["launch/sft.py", f"--config=configs/smollm2.py:sft,{switch}{sizes[1:]}",
                         f"--workdir={sft_dir}"] + sft_args,
          os.path.join(sft_dir, "sft_summary.json"))
    evals[arm] = phase(
        f"eval_{arm}", ["launch/eval.py",
                        f"--config=configs/smollm2.py:{switch}init={sft_dir}/params{sizes}",
                        "--checkpoint=init", "--sets=gsm8k_test",
                        f"--num_problems={a.gsm8k_problems}", f"--workdir={ev}",
                        f"--config.eval.max_new_tokens={budget}"] + shrink.get("eval", []),
        os.path.join(ev, "eval_init.json"))["sets"]["gsm8k_test"]
  over = compare_evals(evals["plain"]["rows"], evals["tool"]["rows"])
  print(gain_line("GSM8K: the tool's cold start over the plain one:", over), flush=True)
  keys = ("pass@1", "format_rate", "response_length_mean", "num_problems", "k", "tool_calls_mean")
  return {"gsm8k": {arm: {k: r.get(k) for k in keys} for arm, r in evals.items()},
          "gsm8k_tool_over_plain": over}


def recipe(name):
  """configs/<name>.py, loaded by path as the launchers do."""
  from magistral_jax.run.recipes import recipe_module
  return recipe_module(os.path.join(common.ROOT, "configs", f"{name}.py"))


if __name__ == "__main__":
  main()
