"""One of the 2 processes of test_hf_sharded.py's many-process load (launch/local_cluster.py, 2
CPU devices each): load_hf_sharded(argv[1]) onto a 2x2 mesh over both processes' devices. Every
shard this process holds must equal the same block of load_hf_safetensors' host copy, and of the
leaves with no layer axis this process must have read only the rows and columns its own devices
hold."""
import sys

import jax
import numpy as np

from magistral_jax.model import hf_sharded
from magistral_jax.model.hf_checkpoint import load_hf_safetensors
from magistral_jax.parallel import multihost
from magistral_jax.parallel.sharding import make_mesh
from magistral_jax.parallel.config import TRAINER_RULES


def main(path):
  multihost.initialize()
  me = jax.process_index()
  assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(),
                                                               jax.device_count())
  read = {}   # tensor name -> elements read() copied out for it on this process
  real_read = hf_sharded._Reader.read

  def counting_read(self, name, box=()):
    out = real_read(self, name, box)
    read[name] = read.get(name, 0) + out.size
    return out

  hf_sharded._Reader.read = counting_read
  mesh = make_mesh({"fsdp": 2, "tensor": 2})
  cfg, params = hf_sharded.load_hf_sharded(path, mesh, TRAINER_RULES)
  _, host = load_hf_safetensors(path)
  checked = 0
  for (kp, got), want in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(host)):
    where = jax.tree_util.keystr(kp)
    assert got.shape == want.shape and got.dtype == want.dtype, where
    assert not got.is_fully_addressable, where   # a global array over both processes
    for shard in got.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data).view(np.uint8),
                                    np.ascontiguousarray(want[shard.index]).view(np.uint8),
                                    err_msg=where)
      checked += 1
  for leaf, name in (("embed", "model.embed_tokens.weight"), ("lm_head", "lm_head.weight")):
    arr = params[leaf]["embedding" if leaf == "embed" else "kernel"]
    mine = {tuple((s.start, s.stop) for s in sh.index): sh.data.size
            for sh in arr.addressable_shards}
    assert read[name] == sum(mine.values()) < arr.size, (name, read[name], mine, arr.size)
  print(f"[p{me}] OK: {checked} shards equal; read {read['model.embed_tokens.weight']} of "
        f"{params['embed']['embedding'].size} embedding elements", flush=True)
  multihost.finish()   # process 0 leaves last (JAX's recoverable mode has no shutdown barrier)


if __name__ == "__main__":
  main(sys.argv[1])
