"""Benchmark: the weight push across processes (LeaderRollouts.push end to end: trainer on
processes 0-1, generator on process 2, 2 CPU devices each) against a device-to-device copy of
the received params in the generator.

  python bench/multihost_push.py [--model smollm2|llama1b|tiny]

Last line, one JSON object: cross_process_over_local_copy, cross_process_GBps, both times.
"""
import json
import statistics
import time

import common   # bench/common.py, beside the script


def child(args) -> None:
  import jax
  from jax.sharding import Mesh, NamedSharding
  import numpy as np
  from magistral_jax.model import named
  from magistral_jax.model import transformer as T
  from magistral_jax.parallel import multihost
  from magistral_jax.parallel.sharding import make_mesh
  from magistral_jax.parallel.config import GENERATOR_RULES, TRAINER_RULES
  from magistral_jax.pipeline.generator_service import in_stream, out_stream
  from magistral_jax.pipeline.remote import weight_transfer

  if args.model == "tiny":   # configs/tiny.py's 0.8M-parameter policy: latency, not bandwidth
    from magistral_jax import config as config_lib
    from magistral_jax.run.recipes import load_recipe
    tiny = config_lib.validate(load_recipe("configs/tiny.py", common.ROOT))
    cfg = tiny.model.replace(param_dtype=args.param_dtype)
    source = "random init (configs/tiny.py shapes)"
  else:
    cfg, _, source, _ = named.load_model(args.model, args.param_dtype, weights="random")
  cfg = cfg.replace(dtype=args.gen_dtype)   # serving dtype: the narrower of the two
  layout = multihost.ProcessLayout(jax.process_index(), jax.process_count(), (0, 1), (2,))
  gdevs = layout.generator_devices()[0]
  transfer = weight_transfer(cfg, make_mesh({"tensor": -1}, gdevs), GENERATOR_RULES,
                             layout.trainer_devices())
  mailbox = multihost.Mailbox("bench")
  rounds = args.reps + 1
  if layout.is_trainer:
    tmesh = make_mesh({"fsdp": -1}, layout.trainer_devices())
    shardings = T.params_on(cfg, tmesh, TRAINER_RULES)
    params = jax.block_until_ready(named.random_params(cfg, shardings))
    push_s = []
    for r in range(rounds):
      t = time.perf_counter()
      transfer.stage(params, r + 1)
      if layout.is_leader:
        _, uuid = transfer.offer(600)
        mailbox.send(in_stream(0, 1), ("push", r + 1, uuid))
        assert mailbox.receive(out_stream(0, 1), 600) == ("ack", r + 1)
      push_s.append(time.perf_counter() - t)
    # The other trainer process stays until the last pull is done: its part of the staging
    # program runs asynchronously, and a process that exits takes it along.
    if not layout.is_leader:
      mailbox.receive("trainers_done", 600)
    else:
      mailbox.send("trainers_done", True)
      copy_s, nbytes = mailbox.receive(out_stream(0, 1), 600)
      push, copy = statistics.median(push_s[1:]), statistics.median(copy_s[1:])
      common.emit({
          "bench": "multihost_push", "model": args.model, "source": source,
          "params_M": round(cfg.num_params() / 1e6, 1), "param_dtype": args.param_dtype,
          "gen_dtype": args.gen_dtype, "bytes_pushed": nbytes,
          "layout": "trainer 2 processes x 2 devices (FSDP) -> generator 1 process x 2 "
                    "devices (tensor parallel)",
          "cross_process_push_s": push, "local_copy_s": copy,
          "cross_process_over_local_copy": push / copy,
          "cross_process_GBps": nbytes / push / 1e9, "local_copy_GBps": nbytes / copy / 1e9,
          "rounds_push_s": [round(x, 4) for x in push_s],
          "rounds_copy_s": [round(x, 4) for x in copy_s], "reps": args.reps,
          **common.host_info()})
  else:
    mesh = make_mesh({"tensor": -1}, gdevs)
    swapped = Mesh(np.asarray(list(mesh.devices.flat)[::-1], dtype=object).reshape(
        mesh.devices.shape), mesh.axis_names)
    copy_s, nbytes = [], 0
    for r in range(rounds):
      kind, version, uuid = mailbox.receive(in_stream(0, 1), 600)
      assert (kind, version) == ("push", r + 1)
      got = transfer.receive(uuid)
      mailbox.send(out_stream(0, 1), ("ack", r + 1))
      nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(got))
      other = jax.tree.map(lambda x: NamedSharding(swapped, x.sharding.spec), got)
      t = time.perf_counter()
      jax.block_until_ready(jax.device_put(got, other, may_alias=False))
      copy_s.append(time.perf_counter() - t)
      del got
    mailbox.send(out_stream(0, 1), (copy_s, nbytes))


def main() -> None:
  p = common.argument_parser(__doc__, model=["smollm2", "llama1b", "tiny"],
                             param_dtype="float32", gen_dtype="bfloat16", reps=5)
  if common.cluster_main(p, child) is not None:
    print(json.dumps(common.cluster_json(__file__, 3, 2, 0, "multihost_push")), flush=True)


if __name__ == "__main__":
  main()
