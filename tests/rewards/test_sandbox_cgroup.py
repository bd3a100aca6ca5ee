"""A run as a whole (issue #64): its CPU counts every descendant, reaped by the kernel or not, in a
session of its own or not; its memory includes shm, memfd and tmpfs pages; its processes are
capped; and each run's cgroup is gone when it is over. Each hostile program runs with a cgroup
(v1 where this host mounts it, v2) and without (the fallback, forced), and must fail in every
mode: at its CPU limit, by the kernel's memory limit, or refused by the filter that stands in
for the cgroup. New variants, not the held-out wave's programs."""
import os
import platform
import subprocess

import pytest

from magistral_jax.rewards import run_cgroup, sandbox, sandbox_root
from magistral_jax.rewards.sandbox_limits import Limits
from magistral_jax.rewards.sandbox_root import SECCOMP, seccomp_program

import hostile_programs as hp
from test_sandbox_wave4 import _run_filter

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the cgroup checks need root")


def _sandbox(mode: str, userns: bool = False) -> sandbox.Sandbox:
  s = sandbox.Sandbox(uid=sandbox.process_uid_base() + 220, cgroup=mode)
  if s.isolation not in sandbox.PRIVATE_FS:
    pytest.skip("no private-filesystem sandbox here")
  if mode != "off" and s.cgroups.version is None:
    pytest.skip(f"no {mode} cgroup here")
  if userns:
    s.isolation = sandbox.ISOLATION_USERNS
  return s


@pytest.fixture(params=["v1", "v2", "off"])
def sbx(request):
  return _sandbox(request.param)


def _run(s, src, limits):
  d = s.make_dir()
  try:
    return s.run(["/usr/bin/python3"], d, limits, python_src=src)
  finally:
    s.remove_dir(d)


def _ours() -> list[str]:
  """The run cgroups this process has left anywhere."""
  out = []
  for h in run_cgroup.own_hierarchies():
    out += [n for n in os.listdir(h.base) if n.startswith(f"{run_cgroup.PREFIX}{os.getpid()}_")]
  return out


# ----------------------------------------------------------------------------- where and what

def test_a_cgroup_is_found_only_under_the_mount_that_reaches_ours(tmp_path):
  (tmp_path / "a" / "b").mkdir(parents=True)
  mp = str(tmp_path)
  assert run_cgroup._under("/a/b", "/", mp) == os.path.join(mp, "a", "b")
  assert run_cgroup._under("/x/a/b", "/x", mp) == os.path.join(mp, "a", "b")
  assert run_cgroup._under("/y/a", "/x", mp) is None         # a mount of another subtree
  assert run_cgroup._under("/a/missing", "/", mp) is None
  with pytest.raises(ValueError, match="MAGISTRAL_SANDBOX_CGROUP"):
    run_cgroup.RunCgroups("v3")


@pytest.mark.parametrize("machine", sorted(SECCOMP))
def test_without_a_cgroup_the_filter_keeps_children_cpu_visible_and_refuses_memfd(machine):
  nums = SECCOMP[machine]
  eperm, allow = sandbox_root.SECCOMP_EPERM, sandbox_root.SECCOMP_ALLOW

  def run(prog, name, arg0=0, arg1=0):
    return _run_filter(prog, nums["arch"], nums[name], arg0, arg1)
  full, none = seccomp_program(nums), seccomp_program(nums, False, False)
  assert run(full, "rt_sigaction", 17, 0x7FFE0000) == allow      # a cgroup counts the tree
  assert run(full, "memfd_create") == allow
  assert run(none, "rt_sigaction", 17, 0x7FFE0000) == eperm      # SIGCHLD: any new action
  assert run(none, "rt_sigaction", 17, 1 << 32) == eperm         # the pointer's high half
  assert run(none, "rt_sigaction", 17, 0) == allow               # a query
  assert run(none, "rt_sigaction", 2, 0x7FFE0000) == allow       # SIGINT: not the reaping one
  assert run(none, "memfd_create") == eperm
  assert run(seccomp_program(nums, True, False), "rt_sigaction", 17, 8) == allow


# ----------------------------------------------------------------------------- CPU of the tree

@pytest.mark.parametrize("src", [hp.KERNEL_REAPED_BURN, hp.ORPHAN_BURN],
                         ids=["kernel_reaped", "orphans"])
def test_the_cpu_limit_counts_every_descendant(sbx, src):
  r = _run(sbx, src, Limits(cpu_s=1.0))
  assert r.stdout.strip() != b"2", (sbx.cgroups.version, r)
  assert r.fault is None
  if sbx.cgroups.version is None and src is hp.KERNEL_REAPED_BURN:
    assert b"PermissionError" in r.stderr         # the filter: no kernel reaping to hide in
  else:
    assert r.timed_out and r.cpu_s >= 1.0, r      # stopped at its CPU limit
  assert not _ours()


def test_an_honest_program_with_children_passes_in_every_mode(sbx):
  src = ("import multiprocessing as mp\nif __name__ == '__main__':\n"
         "  with mp.Pool(2) as p: print(sum(p.map(abs, [-1, -1])))\n")
  r = _run(sbx, src, Limits(cpu_s=3.0))
  assert (r.returncode, r.stdout.strip()) == (0, b"2"), r
  assert not _ours()


def test_the_run_sees_its_cgroup_as_its_root_and_no_cgroupfs():
  r = _run(_sandbox("v1", userns=True), "import os\nprint(open('/proc/self/cgroup').read())\n"
           "print(os.path.exists('/sys/fs/cgroup'))", Limits(cpu_s=2.0))
  assert r.returncode == 0, r
  lines = r.stdout.decode().split()
  assert lines[-1] == "False"
  assert all(line.endswith(":/") for line in lines[:-1]), lines


# ----------------------------------------------------------------------------- memory of the tree

# Unmapped memfd pages; a tree of children each under its own address-space limit.
@pytest.mark.parametrize("src", [hp.MEMFD_HOG, hp.tree_hog(60, 1.0)], ids=["memfd", "tree"])
def test_memory_is_bounded_for_the_whole_tree(sbx, src):
  r = _run(sbx, src, Limits(cpu_s=3.0, memory_mb=100))
  # Bounded by the cgroup's memory controller, or (none: v2 here, the fallback) by the CPU
  # watch's look at the tree, or refused (memfd, without a memory cgroup).
  assert r.stdout.strip() != b"2", r
  assert r.fault is None
  assert not _ours()


def test_sysv_shm_is_bounded_by_the_run_namespace_limits(sbx):
  # One segment over the tmpfs size is refused; two of 8 MB fill the namespace's total.
  src = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
get = lambda mb: libc.shmget(0, ctypes.c_size_t(mb << 20), 0o1600)
print(get(32) < 0, get(8) >= 0, get(8) >= 0, get(8) < 0)
print(open("/proc/sys/kernel/shmmni").read().strip())
"""
  r = _run(sbx, src, Limits(cpu_s=2.0, tmp_mb=16))
  assert r.stdout.split() == [b"True"] * 4 + [str(sandbox.SHM_SEGMENTS).encode()], r


# ----------------------------------------------------------------------------- leftovers

def test_stale_run_cgroups_of_dead_owners_are_swept_and_no_others():
  hs = run_cgroup.own_hierarchies()
  base = next((h.base for h in hs if h.version == 1 and "cpuacct" in h.controllers), None)
  if base is None:
    pytest.skip("no v1 cpuacct hierarchy here")
  p = subprocess.Popen(["true"])
  p.wait()                                 # a pid that is surely dead now
  stale = os.path.join(base, f"{run_cgroup.PREFIX}{p.pid}_0")
  live = os.path.join(base, f"{run_cgroup.PREFIX}{os.getpid()}_sweeptest")
  other = os.path.join(base, f"not_ours_{p.pid}")
  for d in (stale, live, other):
    os.makedirs(d, exist_ok=True)
  try:
    assert run_cgroup.sweep() >= 1
    assert not os.path.exists(stale)
    assert os.path.exists(live) and os.path.exists(other)
    assert run_cgroup.sweep(owner=os.getpid()) >= 1     # a dead worker's, by its pid
    assert not os.path.exists(live)
  finally:
    for d in (stale, live, other):
      if os.path.exists(d):
        os.rmdir(d)


def test_without_any_cgroup_the_sandbox_says_so_loudly(monkeypatch, caplog):
  monkeypatch.setattr(run_cgroup, "_warned", False)
  monkeypatch.setenv(run_cgroup.ENV, "off")
  with caplog.at_level("WARNING"):
    g = run_cgroup.RunCgroups()
  assert g.version is None and g.create(100, 8) is None
  assert "NO PER-RUN CGROUP" in caplog.text


def test_a_run_cgroup_has_its_limits_and_weight_and_goes_when_removed():
  g = run_cgroup.RunCgroups("v1")
  if g.version is None or g.missing:
    pytest.skip("no full v1 set of controllers here")
  group = g.create(100, 8)
  read = lambda c, f: open(os.path.join(group.dirs[c], f)).read().strip()
  try:
    assert read("memory", "memory.limit_in_bytes") == str(100 << 20)
    assert read("pids", "pids.max") == "8"
    assert read("cpu", "cpu.shares") == str(run_cgroup.CPU_WEIGHT_V1)   # one run's share
    assert group.cpu_s() == 0.0
    assert all(os.path.dirname(d) in {h.base for h in run_cgroup.own_hierarchies()}
               for d in group.dirs.values())                          # children of ours only
  finally:
    assert group.remove()
  assert not any(os.path.exists(d) for d in group.dirs.values())
