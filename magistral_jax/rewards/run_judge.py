"""Whose fault a run still going at its wall-clock backstop is: the program's (a time limit, a
wrong answer) or the host's (a VerifierFault: no verdict, the group is dropped).

Limits are CPU seconds, which load cannot move; the backstop behind them (Limits.backstop_s,
3 x the CPU limit + 3 s) only fires for a run that has not used its CPU. The judgement used to
be the run's average CPU share over its whole life, between 5 % and its limit meaning "the host
was too loaded". A program chooses its average: the fourth red-team wave (issue #64) burned a
little CPU and then slept, blocked on its own pipe, deadlocked its threads, waited on a stopped
child or ran a 0.1 s / 0.4 s duty cycle, and every one was judged a verifier fault: the group was
dropped instead of penalised. So a run is now judged by what it was doing when the backstop
fired, from the samples CpuWatch took of it (run_tree.Sample) over the last WINDOW_S:
  - it used its CPU limit: its own time limit;
  - no thread was runnable when it fired (every one sleeping, blocked, stopped: states S, D, T,
    t), or over the window its threads were runnable for less than RUNNABLE_SHARE of the time
    (schedstat: time on a CPU + time waiting for one): it was idle by its own choice;
  - it was runnable but hardly waited for a CPU (schedstat wait under WAIT_SHARE of the
    window): it had the CPU whenever it wanted, so what kept it short of its limit was its own
    idling earlier;
  - it waited, but others used too little of the CPUs we may use to explain it (their busy time
    in /proc/stat, less the run's own, under half its wait, or under OTHERS_SHARE of the window):
    it was waiting mostly for its own threads (many busy threads pinned to one CPU, say);
  - otherwise it was runnable, waiting, and other processes held the CPUs: the host was
    overloaded, a verifier fault.
Where the kernel has no schedstat, the host's CPU pressure (/proc/pressure/cpu, "some" avg10)
stands in for the run's own wait; with neither, a run is never judged a fault (a wrong verdict
under real overload rather than a fault any program could force). A program cannot make itself
runnable-but-waiting without load from others: whatever it runs itself counts towards its CPU
limit, which then ends it first, and that limit counts the run as a whole (its cgroup,
run_cgroup.py; without one, the filter keeps every child's CPU where the watch reads it).
"""
from __future__ import annotations

from magistral_jax.rewards.run_tree import CpuWatch, Sample

WINDOW_S = 2.0          # how far back "what it was doing" looks
RUNNABLE_SHARE = 0.5    # runnable less than this share of the window: it was mostly idle
WAIT_SHARE = 0.25       # waited for a CPU less than this share of the window: it was not starved
OTHERS_SHARE = 0.25     # others used less than this many CPU-seconds per second: no contention
PRESSURE_PCT = 50.0     # without schedstat: host CPU pressure ("some" avg10) that means overload


def cpu_pressure() -> float | None:
  """The host's CPU pressure, "some" avg10 (percent of time some task waited for a CPU)."""
  try:
    with open("/proc/pressure/cpu") as f:
      first = f.readline().split()
    return float(dict(kv.split("=") for kv in first[1:])["avg10"])
  except (OSError, ValueError, KeyError, IndexError):
    return None


def window_start(samples, now: Sample) -> Sample | None:
  """The earliest kept sample within WINDOW_S of `now` (at least one tick before it)."""
  for s in samples:
    if now.t - WINDOW_S <= s.t <= now.t - CpuWatch.EVERY_S * 0.8:
      return s
  return None


def overrun_fault(cpu_limit_s: float, elapsed_s: float, now: Sample, then: Sample | None,
                  pressure: float | None) -> str | None:
  """The fault message for a run still going at its backstop, or None when it is the program's
  doing (see the module docstring for each rule). Pure: the samples and the pressure in."""
  if now.cpu_s >= cpu_limit_s or not now.runnable:
    return None
  why = None
  if then is not None and now.threads is not None and then.threads is not None:
    span = max(now.t - then.t, 1e-3)
    ran = waited = 0
    for tid, (run_ns, wait_ns) in now.threads.items():
      run0, wait0 = then.threads.get(tid, (0, 0))
      ran += max(0, run_ns - run0)
      waited += max(0, wait_ns - wait0)
    ran, waited = ran / 1e9, waited / 1e9
    if ran + waited < RUNNABLE_SHARE * span or waited < WAIT_SHARE * span:
      return None
    why = f"it waited {waited:.2f}s for a CPU in the last {span:.1f}s"
    if now.host_busy_s is not None and then.host_busy_s is not None:
      others = (now.host_busy_s - then.host_busy_s) - (now.cpu_s - then.cpu_s)
      if others < max(OTHERS_SHARE * span, 0.5 * waited):
        return None
      why += f", while others used {others:.1f} CPU-s"
  else:
    if pressure is None or pressure < PRESSURE_PCT:
      return None
    why = f"it was runnable and the host's CPU pressure is {pressure:.0f}%"
  return (f"wall-clock backstop ({elapsed_s:.1f}s) reached after only {now.cpu_s:.2f}s of its "
          f"{cpu_limit_s:g}s CPU limit: {why}: the host is overloaded")


def judge_overrun(watch: CpuWatch, elapsed_s: float, cpu_limit_s: float
                  ) -> tuple[float, str | None]:
  """(CPU used, fault or None) for a run still going at its backstop, measured before it is
  killed: a fresh sample against the window's first (see the module docstring)."""
  now = watch.sample()
  then = window_start(list(watch.samples)[:-1], now)
  return now.cpu_s, overrun_fault(cpu_limit_s, elapsed_s, now, then, cpu_pressure())
