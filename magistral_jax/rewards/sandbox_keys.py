"""Kernel keys a sandbox uid owns, removed after each run (rewards/sandbox.py calls
`remove_uid_keys` once a run of the slot's uid is over).

Why keys at all: the kernel keyring is not namespaced. A key made in one run (add_key, keyctl)
outlives it: in the uid's user keyring or its persistent keyring (kept for days after its last
use), readable by any later run that may view it; a world-readable key is a channel to every
other run of any uid. The fourth red-team wave (issue #64) passed guessed verdicts between runs
of one problem that way, and left keys of the sandbox uids on the host.

The first line is the seccomp filter: keyctl, add_key and request_key are refused inside every
run (sandbox_root.seccomp_program), so no run can make, read or link a key. This sweep is the
second line, for what the filter cannot promise: a machine the filter has no numbers for (it is
then not installed), a kernel with another key interface, a run killed while some future leak is
open. Besides, every run joins a fresh session keyring of its own in the setup (sandbox_root),
so it never holds ours: no key of a run can be linked under the verifier's own keyrings.

How: /proc/key-users says, for every uid that owns keys, how many it holds (readable by anyone,
cheap: the common case, none, costs one read). When the slot uid holds some, a small helper that
we start as root drops to that uid and invalidates every key the uid can reach: the keys it sees
in /proc/keys, and everything in its user, user-session and persistent keyrings (the only places
a later run of the uid could find a key by name), leaves first (a key whose perms give its owner
nothing but view is still reachable through a keyring the helper possesses) and keyrings last, by
serial number (naming the user keyring again would create a new one). keyutils is not needed:
the helper calls keyctl(2) through ctypes. Only as root, where each slot runs as a uid of its
own: in the user-namespace mode the program's keys are owned by our own uid, which also owns the
user's real keys, so nothing is swept there and the filter alone holds (its docstring says so).
"""
from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys

from magistral_jax.rewards.sandbox_root import SECCOMP

log = logging.getLogger(__name__)

KEY_USERS = "/proc/key-users"

# Runs as root with argv [keyctl syscall number, uid]; drops to the uid, then invalidates every key
# the uid can reach (see the module docstring). Prints how many it invalidated.
SWEEP_SOURCE = r"""
import ctypes, os, sys
nr, uid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
def keyctl(*args):
  return libc.syscall(L(nr), *[L(a) if isinstance(a, int) else a for a in args])
GET_KEYRING_ID, DESCRIBE, READ, INVALIDATE, GET_PERSISTENT = 0, 6, 11, 21, 22
USER_KEYRING, USER_SESSION_KEYRING, PROCESS_KEYRING = -4, -5, -2
def describe(k):
  buf = ctypes.create_string_buffer(4096)
  return buf.value.decode(errors="replace") if keyctl(DESCRIBE, k, buf, 4096) >= 0 else ""
def members(k):
  size = keyctl(READ, k, None, 0)
  if size <= 0:
    return []
  buf = ctypes.create_string_buffer(size)
  n = keyctl(READ, k, buf, size)
  return list(memoryview(buf.raw[:max(0, min(n, size)) // 4 * 4]).cast("i"))
# Possession runs user session keyring -> user keyring -> keys, and our process keyring ->
# persistent keyring -> keys: so the keys first, then the persistent keyring, then the user
# keyring, then the user session keyring; our own process keyring is never touched (it holds the
# persistent keyring for us, and goes with this process).
user, user_session = (keyctl(GET_KEYRING_ID, k, 0) for k in (USER_KEYRING, USER_SESSION_KEYRING))
persistent = keyctl(GET_PERSISTENT, -1, PROCESS_KEYRING)
own = keyctl(GET_KEYRING_ID, PROCESS_KEYRING, 0)
last = [k for k in (persistent, user, user_session) if k > 0]
todo = list(last)
with open("/proc/keys") as f:
  for line in f:
    parts = line.split()
    if len(parts) > 5 and parts[5] == str(uid):
      todo.append(int(parts[0], 16))
seen, rings = {own}, set()
while todo:
  k = todo.pop()
  if k in seen or len(seen) > 100000:
    continue
  seen.add(k)
  if describe(k).startswith("keyring;"):
    rings.add(k)
    todo += members(k)
seen.discard(own)
order = sorted(seen - rings) + sorted(rings - set(last)) + last
print(sum(keyctl(INVALIDATE, k) == 0 for k in order))
"""


def parse_key_users(text: str) -> dict[int, int]:
  """{uid: keys it owns} from /proc/key-users' text ("uid: usage nkeys/nikeys qnkeys/maxkeys
  qnbytes/maxbytes" per line)."""
  out = {}
  for line in text.splitlines():
    uid, _, rest = line.partition(":")
    fields = rest.split()
    try:
      out[int(uid)] = int(fields[1].split("/")[0])
    except (ValueError, IndexError):
      continue
  return out


def key_count(uid: int) -> int | None:
  """How many keys `uid` owns; None where the kernel has no keys (no /proc/key-users)."""
  try:
    with open(KEY_USERS) as f:
      return parse_key_users(f.read()).get(uid, 0)
  except OSError:
    return None


_warned = False


def remove_uid_keys(uid: int, timeout_s: float = 10.0) -> int:
  """Invalidates every key `uid` can reach (see the module docstring); how many. Root only, and
  never for root or our own uid. Errors are logged, never raised: the run's verdict stands."""
  global _warned
  if os.geteuid() != 0 or uid in (0, os.getuid()) or not key_count(uid):
    return 0
  numbers = SECCOMP.get(platform.machine())
  if numbers is None:
    if not _warned:
      _warned = True
      log.error("sandbox: uid %d owns kernel keys, and keyctl's number on %s is not known: they "
                "are left", uid, platform.machine())
    return 0
  python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3")
                 if os.access(p, os.X_OK)), sys.executable)
  try:
    r = subprocess.run([python, "-I", "-S", "-c", SWEEP_SOURCE, str(numbers["keyctl"]), str(uid)],
                       capture_output=True, timeout=timeout_s, env={})
    done = int(r.stdout.strip() or 0) if r.returncode == 0 else 0
    if r.returncode != 0:
      log.error("sandbox: removing the keys of uid %d failed: %s", uid,
                r.stderr.decode(errors="replace")[-300:])
  except (OSError, subprocess.SubprocessError, ValueError) as e:
    log.error("sandbox: removing the keys of uid %d failed: %s", uid, e)
    return 0
  if done:
    log.warning("sandbox: removed %d kernel key(s) of sandbox uid %d", done, uid)
  return done
