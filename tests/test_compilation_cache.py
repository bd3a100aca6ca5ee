"""JAX's persistent compilation cache in the launch scripts (cli.compilation_cache): a second
process that compiles the same program loads it from config.compilation_cache_dir, and
JAX_COMPILATION_CACHE_DIR, when set, wins over the config; on CPU a program compiled on one slice
of devices is loaded on another (magistral_jax/parallel/cache_key_patch.py)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process: the config's cache, then a program compiled through it. Prints what it saw.
CHILD = """
import json, sys
from magistral_jax import cli
from magistral_jax.config import default_config
import jax, jax.numpy as jnp
from jax._src import monitoring
hits = []
monitoring.register_event_listener(
    lambda e, **kw: hits.append(e) if e == "/jax/compilation_cache/cache_hits" else None)
c = default_config()
c.compilation_cache_dir, c.compilation_cache_max_gb = sys.argv[1], float(sys.argv[2])
path = cli.compilation_cache(c)
y = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((64, 64)))
print(json.dumps({"path": path, "hits": len(hits), "y": float(y),
                  "max_size": jax.config.jax_compilation_cache_max_size}))
"""


def _child(cache_dir, max_gb=1.0, **env):
  e = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  e.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu", **env)
  r = subprocess.run([sys.executable, "-c", CHILD, str(cache_dir), str(max_gb)], cwd=ROOT,
                     env=e, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
  cache = tmp_path / "xla"
  first = _child(cache)
  assert first["path"] == str(cache) and first["hits"] == 0
  assert first["max_size"] == 2**30
  assert os.listdir(cache)   # the program was written
  second = _child(cache)
  assert second["hits"] >= 1 and second["y"] == first["y"]


def test_the_environment_variable_wins_and_an_empty_one_turns_the_cache_off(tmp_path):
  mine, theirs = tmp_path / "mine", tmp_path / "theirs"
  got = _child(mine, JAX_COMPILATION_CACHE_DIR=str(theirs))
  assert got["path"] == str(theirs) and os.listdir(theirs) and not mine.exists()
  got = _child(mine, JAX_COMPILATION_CACHE_DIR="")
  assert got["path"] is None and not mine.exists()


def test_off_and_a_bad_limit(monkeypatch):
  from magistral_jax import cli
  from magistral_jax.config import default_config
  c = default_config()
  assert c.compilation_cache_dir == "~/.cache/magistral_jax/xla"
  c.compilation_cache_dir = ""
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  assert cli.compilation_cache(c) is None
  c.compilation_cache_dir, c.compilation_cache_max_gb = "/nonexistent/xla", -1.0
  with pytest.raises(ValueError, match="compilation_cache_max_gb"):
    cli.compilation_cache(c)


def test_no_limit(tmp_path):
  assert _child(tmp_path / "xla", max_gb=0.0)["max_size"] == -1


# One process, 8 CPU devices: the same program (collectives whose result depends on each device's
# place in the mesh) on three 2-device slices, the last in reverse order.
SLICES = """
import json, sys
import numpy as np
from magistral_jax.parallel.cache_key_patch import share_cpu_executables_across_devices
shared = sys.argv[2] == "1" and share_cpu_executables_across_devices()
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax._src import monitoring
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
events = []
monitoring.register_event_listener(
    lambda e, **kw: events.append(e.rsplit("/", 1)[-1])
    if e.startswith("/jax/compilation_cache/cache_") else None)
def f(x):
  y = jax.lax.psum(x, "t") * (1 + jax.lax.axis_index("t"))
  return jax.lax.ppermute(y, "t", [(0, 1), (1, 0)]) + jax.lax.all_gather(x, "t", tiled=True)[:2]
out = []
for ids in ([0, 1], [2, 3], [5, 4]):
  mesh = Mesh(np.array([jax.devices()[i] for i in ids]), ("t",))
  x = jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mesh, P("t")))
  n = len(events)
  y = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("t"), out_specs=P("t")))(x)
  out.append({"hit": "cache_hits" in events[n:], "y": np.asarray(y).tolist(),
              "devices": [s.device.id for s in sorted(y.addressable_shards,
                                                      key=lambda s: s.index[0].start)]})
print(json.dumps({"shared": shared, "slices": out}))
"""


@pytest.mark.parametrize("share", [True, False])
def test_a_program_compiled_on_one_device_slice_loads_on_another(tmp_path, share):
  """cache_key_patch.share_cpu_executables_across_devices: on CPU the cache key leaves out which
  devices run the program, so a second slice (even in another order) loads the first slice's
  executable, binds it to its own devices and computes the same values. Without it (JAX's own
  keys) each slice compiles its own."""
  e = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS")}
  e.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu",
           XLA_FLAGS="--xla_force_host_platform_device_count=8")
  r = subprocess.run([sys.executable, "-c", SLICES, str(tmp_path / "xla"), str(int(share))],
                     cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got["shared"] == share
  assert [s["hit"] for s in got["slices"]] == [False, share, share]
  assert [s["devices"] for s in got["slices"]] == [[0, 1], [2, 3], [5, 4]]
  x = np.arange(16.0).reshape(4, 4)
  total = x[:2] + x[2:]
  want = np.concatenate([2 * total + x[:2], total + x[:2]])   # shard 0 receives shard 1's, etc.
  for s in got["slices"]:
    np.testing.assert_array_equal(np.asarray(s["y"]), want)


def test_a_jax_without_the_wrapped_functions_keeps_its_own_keys(monkeypatch):
  from jax._src import cache_key
  from magistral_jax.parallel import cache_key_patch
  # installed (conftest) and idempotent
  assert cache_key_patch.share_cpu_executables_across_devices()
  monkeypatch.setattr(cache_key, "get", lambda *a, **k: None)
  monkeypatch.setattr(cache_key, "_hash_serialized_compile_options", lambda h, o: None)
  assert not cache_key_patch.share_cpu_executables_across_devices()
  assert cache_key.get.__name__ == "<lambda>"   # left as it was


def test_a_cpu_key_tells_one_process_from_several():
  """The same program on the same device ids gets another key once the run has several processes
  (gloo collectives, devices in other processes), and another for each process layout; a
  one-process key is JAX's (stripped of the device assignment) unchanged."""
  from magistral_jax.parallel.cache_key_patch import with_process_layout
  key = "jit_step-" + "ab" * 32
  assert with_process_layout(key, (1, (0, 0, 0, 0))) == key
  two = with_process_layout(key, (3, (0, 0, 1, 1)))
  one = with_process_layout(key, (3, (0, 0, 0, 0)))
  assert len({key, two, one}) == 3
  assert two.startswith("jit_step-") and len(two) == len(key)
  assert with_process_layout(key, (3, (0, 0, 1, 1))) == two   # the same in every process
