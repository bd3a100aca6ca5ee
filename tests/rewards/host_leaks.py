"""What a sandboxed run can leave on the host, found by scanning it: files in the write targets,
processes of the sandbox uids (or children of ours), SysV and POSIX IPC objects, listening
sockets, run cgroups, keys of the sandbox uids; and the secrets the reading attacks look for, planted outside any run (files and IPC
objects). Used by bench/sandbox_soak.py (after a pool closes) and by
tests/rewards/test_sandbox_soak.py (the negative controls: a planted leak of each kind is seen).

Each `leaked_*` compares a scan after with one before and returns (entries attributed to the
attacks of hostile_programs.py or to the sandbox uids, count of other new entries on the host).
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import time

import psutil

from magistral_jax.rewards import run_cgroup, sandbox_keys

from hostile_programs import (IPC_KEY_LEFT, IPC_KEY_PLANTED, MARK, MQ_LEFT, MQ_PLANTED,
                              PLANTED, WRITE_TARGETS)


def listing() -> dict[str, tuple[int, float]]:
  """path -> (owner uid, mtime) of every entry at the top of the write targets (leaked_files also
  looks one level down in the scratch dirs for an attack's name)."""
  out = {}
  for d in WRITE_TARGETS:
    try:
      names = os.listdir(d)
    except OSError:
      continue
    for n in names:
      p = os.path.join(d, n)
      try:
        st = os.lstat(p)
      except OSError:
        continue
      out[p] = (st.st_uid, st.st_mtime)
  return out


def leaked_files(before: dict, after: dict, uids: range, worker_pids: set[int]) -> tuple[list, int]:
  """(entries attributed to this run, count of other new entries). Attributed: an attack's MARK
  name, owned by a sandbox uid, or a run dir (mj_sbx_<pid>_) of one of the pool's workers."""
  leaked, other = [], 0
  for p, (uid, _) in after.items():
    name = os.path.basename(p)
    run_dir = re.match(r"mj_sbx_(\d+)_", name)
    ours = (MARK in name and not name.startswith(MARK + "_planted")) or uid in uids or \
        (run_dir is not None and int(run_dir.group(1)) in worker_pids)
    if ours:
      leaked.append(p)
    elif p not in before:
      other += 1
  # Also anywhere one level down in the scratch dirs (an attack could nest).
  for d in ("/tmp", "/dev/shm", "/var/tmp"):
    for p in glob.glob(os.path.join(d, "*", f"*{MARK}*")):
      if p not in leaked and not os.path.basename(p).startswith(MARK + "_planted"):
        leaked.append(p)
  return sorted(leaked), other


def leaked_processes(uids: range) -> list[dict]:
  """Processes of the sandbox uids (real, effective or saved) anywhere on the host, and children
  of this process still alive."""
  me = psutil.Process()
  found = {}
  for p in psutil.process_iter(["pid", "ppid", "uids", "name", "cmdline", "status",
                                 "create_time"]):
    try:
      u = p.info["uids"]
      if u and any(x in uids for x in u):
        found[p.pid] = dict(pid=p.pid, ppid=p.info["ppid"], uids=list(u), name=p.info["name"],
                            status=p.info["status"], age_s=time.time() - p.info["create_time"],
                            cmdline=" ".join(p.info["cmdline"] or [])[:120])
    except (psutil.Error, TypeError):
      pass
  for c in me.children(recursive=True):
    try:
      if "multiprocessing.resource_tracker" in " ".join(c.cmdline()):
        continue   # multiprocessing's own helper of this process, alive until it exits
      found[c.pid] = dict(pid=c.pid, ppid=c.ppid(), uids=list(c.uids()), name=c.name(),
                          status=c.status(), age_s=time.time() - c.create_time(),
                          cmdline=" ".join(c.cmdline())[:120])
    except psutil.Error:
      pass
  return list(found.values())


_LIBC = None


def libc():
  """This process's libc, for the IPC calls Python has no module for (sysv_ipc is not a
  dependency): shmget & co., mq_open & co."""
  global _LIBC
  if _LIBC is None:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.shmat.restype = ctypes.c_void_p
    _LIBC.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
    _LIBC.shmdt.argtypes = (ctypes.c_void_p,)
    _LIBC.shmctl.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    _LIBC.msgctl.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
  return _LIBC


IPC_CREAT, IPC_EXCL, IPC_RMID, IPC_NOWAIT = 0o1000, 0o2000, 0, 0o4000


class _Msg(ctypes.Structure):
  _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 256)]


def sysv_objects() -> dict[tuple, dict]:
  """Every SysV IPC object of this IPC namespace (the host's, for us): (kind, id, key, creator
  uid) -> {kind, id, key, uid, cuid}, from /proc/sysvipc/{shm,sem,msg}."""
  out = {}
  for kind in ("shm", "sem", "msg"):
    try:
      with open(f"/proc/sysvipc/{kind}") as f:
        header, *rows = f.read().splitlines()
    except (OSError, ValueError):
      continue
    cols = header.split()
    for row in rows:
      d = dict(zip(cols, row.split()))
      try:
        o = dict(kind=kind, id=int(d[kind + "id" if kind != "msg" else "msqid"]), key=int(d["key"]),
                 uid=int(d["uid"]), cuid=int(d["cuid"]))
      except (KeyError, ValueError):
        continue
      out[(kind, o["id"], o["key"], o["cuid"])] = o
  return out


def leaked_sysv(before: dict, after: dict, uids) -> tuple[list[dict], int]:
  """(new SysV objects attributed to this run, count of other new ones). Attributed: the attacks'
  key, or owned or created by a sandbox uid (an IPC_PRIVATE object has no key to tell)."""
  leaked, other = [], 0
  for k, o in after.items():
    if k in before or o["key"] == IPC_KEY_PLANTED:
      continue
    if o["key"] == IPC_KEY_LEFT or o["uid"] in uids or o["cuid"] in uids:
      leaked.append(o)
    else:
      other += 1
  return leaked, other


def mqueue_listing() -> str:
  """How posix_mqueues sees message queues: the /dev/mqueue listing where it is mounted; else
  (we mount nothing on the host) by opening the names the attacks use."""
  return "mounted" if os.path.ismount("/dev/mqueue") else "probed_names"


def posix_mqueues() -> set[str]:
  """POSIX message queues of this IPC namespace: all of them, or the attacks' names (above)."""
  if mqueue_listing() == "mounted":
    return {"/" + n for n in os.listdir("/dev/mqueue")}
  found = set()
  for name in (MQ_LEFT, MQ_PLANTED):
    fd = libc().mq_open(name.encode(), os.O_RDONLY)
    if fd >= 0:
      libc().mq_close(fd)
      found.add(name)
  return found


def leaked_mqueues(before: set, after: set) -> tuple[list[str], int]:
  new = sorted(after - before - {MQ_PLANTED})
  leaked = [n for n in new if MARK in n]
  return leaked, len(new) - len(leaked)


def leaked_posix_shm(before: dict, after: dict, uids) -> tuple[list[str], int]:
  """(new /dev/shm entries of this run: POSIX shared memory and named semaphores are files there,
  count of other new ones), from `listing()`s."""
  leaked, other = [], 0
  for p, (uid, _) in after.items():
    if not p.startswith("/dev/shm/") or p in before:
      continue
    name = os.path.basename(p)
    if (MARK in name and not name.startswith(MARK + "_planted")) or uid in uids:
      leaked.append(p)
    else:
      other += 1
  return sorted(leaked), other


def listeners() -> dict[tuple, dict]:
  """Listening sockets of this network namespace (the host's, for us): (proto, inode) ->
  {proto, local, uid, inode}, from /proc/net/tcp, tcp6 (state 0A) and unix (__SO_ACCEPTCON)."""
  out = {}
  for proto in ("tcp", "tcp6"):
    try:
      with open(f"/proc/net/{proto}") as f:
        rows = f.read().splitlines()[1:]
    except OSError:
      continue
    for row in rows:
      v = row.split()
      if len(v) > 9 and v[3] == "0A":
        out[(proto, int(v[9]))] = dict(proto=proto, local=v[1], uid=int(v[7]), inode=int(v[9]))
  try:
    with open("/proc/net/unix") as f:
      rows = f.read().splitlines()[1:]
  except OSError:
    rows = []
  for row in rows:
    v = row.split()
    if len(v) > 6 and int(v[3], 16) & 0x10000:
      out[("unix", int(v[6]))] = dict(proto="unix", local=v[7] if len(v) > 7 else "", uid=None,
                                      inode=int(v[6]))
  return out


def _socket_holders(inodes: set[int]) -> dict[int, list[int]]:
  """inode -> pids holding that socket, from /proc/*/fd."""
  want = {f"socket:[{i}]": i for i in inodes}
  out: dict[int, list[int]] = {}
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
      continue
    for fd in fds:
      try:
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
      except OSError:
        continue
      if link in want:
        out.setdefault(want[link], []).append(int(pid))
  return out


def _uids_of(pid: int) -> list[int]:
  try:
    with open(f"/proc/{pid}/status") as f:
      return next([int(x) for x in l.split()[1:]] for l in f if l.startswith("Uid:"))
  except (OSError, StopIteration, ValueError):
    return []


def leaked_listeners(before: dict, after: dict, uids) -> tuple[list[dict], int]:
  """(new listening sockets of this run, count of other new ones). Attributed: owned by a sandbox
  uid, or held by a process of one or by a descendant of this process."""
  new = {k: v for k, v in after.items() if k not in before}
  if not new:
    return [], 0
  holders = _socket_holders({v["inode"] for v in new.values()})
  try:
    ours = {c.pid for c in psutil.Process().children(recursive=True)}
  except psutil.Error:
    ours = set()
  leaked, other = [], 0
  for v in new.values():
    pids = holders.get(v["inode"], [])
    if v["uid"] in uids or any(p in ours or set(_uids_of(p)) & set(uids) for p in pids):
      leaked.append({**v, "holders": pids[:4]})
    else:
      other += 1
  return leaked, other


def remove_ipc(sysv: list[dict], mqueues: list[str], shm_files: list[str]) -> int:
  """Removes the IPC objects a run left (after they were counted), so the soak itself leaves
  nothing behind. Returns how many it removed."""
  c, n = libc(), 0
  for o in sysv:
    if o["kind"] == "sem":
      n += c.semctl(o["id"], 0, IPC_RMID) == 0
    else:
      n += (c.shmctl if o["kind"] == "shm" else c.msgctl)(o["id"], IPC_RMID, None) == 0
  for name in mqueues:
    n += c.mq_unlink(name.encode()) == 0
  for p in shm_files:
    try:
      os.remove(p)
      n += 1
    except OSError:
      pass
  return n


def plant_ipc(secret: str) -> list[tuple[str, int]]:
  """The secret in a SysV shared memory segment, a SysV message queue and a POSIX message queue,
  world-readable (only an IPC namespace keeps them out of sight), as an earlier run that knew the
  answer could leave it. Returns what to remove."""
  c, made = libc(), []
  text = secret.encode()
  shm = c.shmget(IPC_KEY_PLANTED, 4096, IPC_CREAT | IPC_EXCL | 0o644)
  if shm >= 0:
    made.append(("shm", shm))
    addr = c.shmat(shm, None, 0)
    if addr not in (None, ctypes.c_void_p(-1).value):
      ctypes.memmove(addr, text, len(text))
      c.shmdt(addr)
  q = c.msgget(IPC_KEY_PLANTED, IPC_CREAT | IPC_EXCL | 0o666)   # writable: readers put it back
  if q >= 0:
    made.append(("msg", q))
    c.msgsnd(q, ctypes.byref(_Msg(1, text)), len(text), IPC_NOWAIT)
  mq = c.mq_open(MQ_PLANTED.encode(), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666, None)
  if mq >= 0:
    made.append(("mq", 0))
    c.mq_send(mq, text, len(text), 0)
    c.mq_close(mq)
  return made


def unplant_ipc(made: list[tuple[str, int]]):
  remove_ipc([dict(kind=k, id=i) for k, i in made if k != "mq"],
             [MQ_PLANTED] if any(k == "mq" for k, _ in made) else [], [])


def plant_files(secret: str) -> list[str]:
  """The secret in hostile_programs.PLANTED (and as a C string literal beside each, for the
  compile-time #include), world-readable: only the private root keeps it out of sight. Returns
  the paths, for unplant_files."""
  paths = []
  for p in PLANTED:
    for path, text in ((p, secret + "\n"), (p + "_lit", f'"{secret}"\n')):
      with open(path, "w") as f:
        f.write(text)
      os.chmod(path, 0o644)
      paths.append(path)
  return paths


def unplant_files(paths: list[str]):
  for p in paths:
    try:
      os.remove(p)
    except OSError:
      pass


def run_cgroups() -> set[str]:
  """Every run cgroup (rewards/run_cgroup.py) under our own cgroups, in every hierarchy."""
  out = set()
  for h in run_cgroup.own_hierarchies():
    try:
      out.update(os.path.join(h.base, n) for n in os.listdir(h.base)
                 if n.startswith(run_cgroup.PREFIX))
    except OSError:
      continue
  return out


def uid_keys(uids) -> dict[int, int]:
  """{uid: keys it owns} for the uids that own any (none where the kernel has no keys)."""
  try:
    with open(sandbox_keys.KEY_USERS) as f:
      owned = sandbox_keys.parse_key_users(f.read())
  except OSError:
    return {}
  return {u: owned[u] for u in uids if owned.get(u)}


def new_keys(before: dict[int, int], uids, wait_s: float = 10.0) -> dict[int, int]:
  """{uid: keys it owns beyond `before`}, once the kernel's key collector has caught up with the
  keys a sweep invalidated (it frees them a few moments later): `wait_s` at most."""
  deadline = time.monotonic() + wait_s
  while True:
    new = {u: n - before.get(u, 0) for u, n in uid_keys(uids).items() if n > before.get(u, 0)}
    if not new or time.monotonic() > deadline:
      return new
    time.sleep(0.1)


def snapshot(uids=()) -> dict:
  """One scan of everything `report` compares: files, SysV objects, POSIX message queues,
  listening sockets, run cgroups and the keys of `uids`."""
  return dict(files=listing(), sysv=sysv_objects(), mqueues=posix_mqueues(),
              listeners=listeners(), cgroups=run_cgroups(), keys=uid_keys(uids))


def report(before: dict, uids: range, worker_pids: set[int]) -> dict:
  """What the runs left since `before` (a `snapshot`): each kind's count and first few, the new
  entries of other processes counted apart. The IPC objects found are removed after counting, so
  that the caller leaves nothing behind either."""
  # A sandboxed process killed with its namespace can stay a few moments as a zombie waiting for
  # the host's init to reap it: wait for the count to settle (10 s at most).
  for _ in range(20):
    procs = leaked_processes(uids)
    if not procs:
      break
    time.sleep(0.5)
  zombies = [p for p in procs if p["status"] == psutil.STATUS_ZOMBIE]
  procs = [p for p in procs if p["status"] != psutil.STATUS_ZOMBIE]
  after = snapshot()
  files, other = leaked_files(before["files"], after["files"], uids, worker_pids)
  run_dirs = [p for p in files if re.match(r"mj_sbx_\d+_", os.path.basename(p))]
  owned = {os.lstat(p).st_uid for p in files if os.path.lexists(p)}
  sysv, sysv_other = leaked_sysv(before["sysv"], after["sysv"], uids)
  mqs, mq_other = leaked_mqueues(before["mqueues"], after["mqueues"])
  shm, shm_other = leaked_posix_shm(before["files"], after["files"], uids)
  socks, socks_other = leaked_listeners(before["listeners"], after["listeners"], uids)
  cgroups = sorted(after["cgroups"] - before["cgroups"])
  keys = new_keys(before["keys"], uids)
  return dict(
      zombies_unreaped=len(zombies),   # dead, holding only a pid entry (host init's to reap)
      leaked_processes=len(procs), leaked_processes_first=procs[:5],
      leaked_uids=sorted({u for p in procs for u in p["uids"] if u in uids} | (owned & set(uids))),
      leaked_files=len(files), leaked_files_first=files[:8], leaked_run_dirs=len(run_dirs),
      new_entries_unattributed=other,
      leaked_sysv_ipc=len(sysv), leaked_sysv_ipc_first=sysv[:5],
      leaked_posix_mqueues=len(mqs), leaked_posix_mqueues_first=mqs[:5],
      leaked_posix_shm=len(shm), leaked_posix_shm_first=shm[:5],
      new_ipc_unattributed=sysv_other + mq_other + shm_other,
      leaked_listeners=len(socks), leaked_listeners_first=socks[:5],
      new_listeners_unattributed=socks_other, mqueue_listing=mqueue_listing(),
      leaked_cgroups=len(cgroups), leaked_cgroups_first=cgroups[:5],
      leaked_keys=sum(keys.values()), leaked_keys_by_uid=keys,
      leaked_ipc_removed=remove_ipc(sysv, mqs, shm))
