"""JAX's persistent compilation cache in the launch scripts (cli.compilation_cache): a second
process that compiles the same program loads it from config.compilation_cache_dir, and
JAX_COMPILATION_CACHE_DIR, when set, wins over the config."""
import json
import os
import subprocess
import sys

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
