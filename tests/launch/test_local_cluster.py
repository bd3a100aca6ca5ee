"""launch/local_cluster.py (parallel/local_cluster.py): N processes of one run on this machine, their environment, prefixed
logs, and supervision (a failure stops the rest, no orphan grandchildren). The children are small
plain-Python scripts, no jax."""
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from magistral_jax.parallel import local_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def script(tmp_path, body: str, name="child.py") -> str:
  path = tmp_path / name
  path.write_text("import json, os, signal, subprocess, sys, time\n"
                  "PID = int(os.environ['MAGISTRAL_PROCESS_ID'])\n" + textwrap.dedent(body))
  return str(path)


def gone(pid: int, timeout: float = 5.0) -> bool:
  """The process no longer exists (or is a zombie waiting for init to reap it)."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    try:
      with open(f"/proc/{pid}/status") as f:
        if any(l.startswith("State:") and ("Z" in l or "X" in l) for l in f):
          return True
    except FileNotFoundError:
      return True
    time.sleep(0.05)
  return False


def test_child_env_replaces_the_device_count():
  base = {"XLA_FLAGS": f"--xla_foo=1 {DEVICE_FLAG}=8 --xla_bar", "HOME": "/h"}
  env = local_cluster.child_env(base, 1, 3, 2, "127.0.0.1:1234", "127.0.0.1:5678")
  assert env["HOME"] == "/h" and base["XLA_FLAGS"].endswith("--xla_bar")  # base untouched
  assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_bar", f"{DEVICE_FLAG}=2"]
  assert (env["MAGISTRAL_COORDINATOR"], env["MAGISTRAL_NUM_PROCESSES"],
          env["MAGISTRAL_PROCESS_ID"], env["MAGISTRAL_TRANSFER_ADDRESS"],
          env["PYTHONUNBUFFERED"]) == ("127.0.0.1:1234", "3", "1", "127.0.0.1:5678", "1")
  assert local_cluster.child_env({}, 0, 1, 4, "c", "t")["XLA_FLAGS"] == f"{DEVICE_FLAG}=4"
  assert local_cluster.child_argv(["a.py", "--distributed", "--x=1"]).count("--distributed") == 1
  assert local_cluster.child_argv(["a.py"])[1:] == ["a.py", "--distributed"]
  ports = local_cluster.free_ports(5)
  assert len(set(ports)) == 5 and all(p > 0 for p in ports)


def test_every_process_gets_its_own_id_and_port(tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", f"--xla_foo=1 {DEVICE_FLAG}=8")
  child = script(tmp_path, """
      keys = ['MAGISTRAL_COORDINATOR', 'MAGISTRAL_NUM_PROCESSES', 'MAGISTRAL_PROCESS_ID',
              'MAGISTRAL_TRANSFER_ADDRESS', 'XLA_FLAGS', 'PYTHONUNBUFFERED']
      print(json.dumps({'env': {k: os.environ[k] for k in keys}, 'argv': sys.argv[1:]}))
      print(f'hello from {PID}', file=sys.stderr)
  """)
  out, log_dir = io.StringIO(), tmp_path / "logs"
  rc = local_cluster.run_cluster([child, "--x=1"], num_processes=3, devices_per_process=2,
                                 grace_s=5, log_dir=str(log_dir), out=out)
  text = out.getvalue()
  assert rc == 0, text
  seen = {}
  for line in text.splitlines():
    for i in range(3):
      if line.startswith(f"[p{i}] {{"):
        seen[i] = json.loads(line[len(f"[p{i}] "):])
  assert sorted(seen) == [0, 1, 2], text
  envs = [seen[i]["env"] for i in range(3)]
  assert [e["MAGISTRAL_PROCESS_ID"] for e in envs] == ["0", "1", "2"]
  assert {e["MAGISTRAL_NUM_PROCESSES"] for e in envs} == {"3"}
  coordinators = {e["MAGISTRAL_COORDINATOR"] for e in envs}
  assert len(coordinators) == 1 and coordinators.pop().startswith("127.0.0.1:")
  transfers = [e["MAGISTRAL_TRANSFER_ADDRESS"] for e in envs]
  assert len(set(transfers)) == 3 and all(t.startswith("127.0.0.1:") for t in transfers)
  assert envs[0]["MAGISTRAL_COORDINATOR"] not in transfers
  for e in envs:
    assert e["XLA_FLAGS"].split() == ["--xla_foo=1", f"{DEVICE_FLAG}=2",
                                      *local_cluster.ONE_CPU_THREAD]
    assert e["PYTHONUNBUFFERED"] == "1"
  for i in range(3):
    assert seen[i]["argv"] == ["--x=1", "--distributed"]
    assert f"[p{i}] hello from {i}" in text.splitlines()  # stderr too, prefixed
    raw = (log_dir / f"process_{i}.log").read_text().splitlines()
    assert f"hello from {i}" in raw and json.loads(next(l for l in raw if l.startswith("{")))
    assert not any(l.startswith("[p") for l in raw)  # raw lines, no prefix
  # Whole lines only: every line is the launcher's or one process's.
  assert all(l.startswith(("[p0] ", "[p1] ", "[p2] ", "local_cluster: "))
             for l in text.splitlines()), text


def test_a_failure_stops_the_others_after_the_grace_period(tmp_path):
  child = script(tmp_path, """
      if PID == 1:
        time.sleep(0.3)
        sys.exit(3)
      print('waiting', flush=True)
      time.sleep(1000)
  """)
  out = io.StringIO()
  t = time.time()
  rc = local_cluster.run_cluster([child], num_processes=3, grace_s=1, out=out)
  took, text = time.time() - t, out.getvalue()
  assert rc == 3, text
  assert took < 12, (took, text)
  assert "local_cluster: process 1 exited with code 3" in text
  summary = [l for l in text.splitlines() if l.startswith("local_cluster: failed:")]
  assert len(summary) == 1, text
  assert summary[0].startswith("local_cluster: failed: process 1 (exit code 3)"), summary
  assert "process 0 (killed by SIGTERM)" in summary[0] and "process 2 (killed by SIGTERM)" in \
      summary[0], summary


def test_no_grandchild_survives(tmp_path):
  # Process 0 starts a grandchild and exits 0 (only the final sweep can catch that one), process
  # 2 starts one that ignores SIGTERM and waits (it outlives the SIGTERM to its group), process 1
  # fails once both are running.
  child = script(tmp_path, f"""
      def grandchild(ignore_term):
        code = ('import signal, time; '
                + ('signal.signal(signal.SIGTERM, signal.SIG_IGN); ' if ignore_term else '')
                + 'time.sleep(1000)')
        g = subprocess.Popen([sys.executable, '-c', code])
        time.sleep(0.2)
        with open({str(tmp_path)!r} + f'/gc_{{PID}}.tmp', 'w') as f:
          f.write(str(g.pid))
        os.rename({str(tmp_path)!r} + f'/gc_{{PID}}.tmp', {str(tmp_path)!r} + f'/gc_{{PID}}')
      if PID == 0:
        grandchild(False)
      elif PID == 2:
        grandchild(True)
        time.sleep(1000)
      else:
        while not all(os.path.exists({str(tmp_path)!r} + f'/gc_{{i}}') for i in (0, 2)):
          time.sleep(0.05)
        sys.exit(1)
  """)
  out = io.StringIO()
  rc = local_cluster.run_cluster([child], num_processes=3, grace_s=0.5, out=out)
  text = out.getvalue()
  assert rc == 1, text
  assert "process 1 (exit code 1)" in text and "process 0 (" not in text, text
  pids = [int((tmp_path / f"gc_{i}").read_text()) for i in (0, 2)]
  survivors = [pid for pid in pids if not gone(pid)]
  for pid in survivors:  # not left behind when the test fails
    os.kill(pid, signal.SIGKILL)
  assert not survivors, f"grandchildren {survivors} (of processes 0, 2: {pids}) survived"


def test_a_process_killed_by_sigkill_is_reported(tmp_path):
  child = script(tmp_path, """
      if PID == 1:
        os.kill(os.getpid(), 9)
      print('done')
  """)
  out = io.StringIO()
  rc = local_cluster.run_cluster([child], num_processes=2, grace_s=5, out=out)
  text = out.getvalue()
  assert rc == 1, text
  assert "local_cluster: process 1 exited with code -9 (killed by SIGKILL)" in text, text
  assert "local_cluster: failed: process 1 (killed by SIGKILL)" in text, text
  assert "[p0] done" in text


def test_launcher_flags_and_sigterm(tmp_path):
  launcher = os.path.join(ROOT, "launch", "local_cluster.py")
  r = subprocess.run([sys.executable, launcher, "--num_processes=2"], capture_output=True,
                     text=True, timeout=30)
  assert r.returncode != 0 and "no command" in r.stderr + r.stdout
  r = subprocess.run([sys.executable, launcher, "--num_processes=0", "--", "x.py"],
                     capture_output=True, text=True, timeout=30)
  assert r.returncode != 0 and "num_processes" in r.stderr

  # SIGTERM to the launcher: SIGTERM to every process, which are gone when it returns.
  child = script(tmp_path, """
      print('ready', os.getpid(), flush=True)
      time.sleep(1000)
  """)
  proc = subprocess.Popen([sys.executable, launcher, "--num_processes=2", "--", child],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines, pids = [], []
  try:
    for line in proc.stdout:
      lines.append(line)
      if " ready " in line:
        pids.append(int(line.split()[-1]))
        if len(pids) == 2:
          break
    assert len(pids) == 2, "".join(lines)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=20)
  finally:
    if proc.poll() is None:
      proc.kill()
  text = "".join(lines) + rest
  assert proc.returncode == 1, text
  assert "local_cluster: got SIGTERM" in text
  assert "process 0 (killed by SIGTERM)" in text and "process 1 (killed by SIGTERM)" in text
  assert all(gone(pid) for pid in pids)
