"""Benchmark: bulk data between two JAX processes, parallel.bulk.BulkChannel against the
coordination service's key-value store (Mailbox's): an array of each size, both ways alternating,
timed to the receiver's numpy array and the sender's acknowledgement.

  python bench/multihost_bulk.py [--sizes 1,16,64,256,1024]

Last line, one JSON object: MB/s per size and way, bulk_over_kv_throughput (median over sizes).
"""
import json
import pickle
import statistics
import sys
import time

import common   # bench/common.py, beside the script


def child(args) -> None:
  import jax
  import numpy as np
  from magistral_jax.parallel import multihost
  from magistral_jax.parallel.bulk import BulkChannel
  me = jax.process_index()
  mailbox = multihost.Mailbox("bench")
  client = mailbox._client
  channel = BulkChannel(mailbox, "data", 1, 0)
  sizes = [int(float(s) * (1 << 20)) for s in args.sizes.split(",")]
  times: dict = {}
  for n in sizes:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8) if me == 1 else None
    for rep in range(args.reps + 1):   # the first round warms up
      for way in (("bulk", "kv") if rep % 2 == 0 else ("kv", "bulk")):
        key = f"kv/{n}/{rep}"
        if me == 1:
          t = time.perf_counter()
          if way == "bulk":
            channel.send({"x": data})
          else:
            client.key_value_set_bytes(key, pickle.dumps(data))
          mailbox.receive("ack", 600)
          if rep:
            times.setdefault((way, n), []).append(time.perf_counter() - t)
        else:
          if way == "bulk":
            got = channel.receive(600)[0]["x"]
          else:
            got = pickle.loads(client.blocking_key_value_get_bytes(key, 600_000))
            client.key_value_delete(key)
          if rep == 1:
            assert got.shape == (n,) and got[:1000].tolist() == np.random.default_rng(n).integers(
                0, 256, n, dtype=np.uint8)[:1000].tolist(), "wrong bytes"
          del got
          mailbox.send("ack", True)
    del data
  if me == 1:
    rows = []
    for n in sizes:
      b, k = statistics.median(times[("bulk", n)]), statistics.median(times[("kv", n)])
      rows.append({"mb": n / (1 << 20), "bulk_MBps": n / b / 1e6, "kv_MBps": n / k / 1e6,
                   "bulk_s": b, "kv_s": k, "ratio": k / b})
    print(json.dumps({"rows": rows}), flush=True)


def main() -> None:
  p = common.argument_parser(__doc__, sizes=("1,16,64,256,1024", "MB, comma-separated"), reps=3)
  args = common.cluster_main(p, child)
  if args is None:
    return
  rows = common.cluster_json(__file__, 2, 1, 1, "multihost_bulk")["rows"]
  for r in rows:
    print(json.dumps({k: round(v, 4) for k, v in r.items()}), file=sys.stderr)
  ratio = statistics.median(r["ratio"] for r in rows)
  common.emit({"sizes_mb": [r["mb"] for r in rows],
               "bulk_MBps": [round(r["bulk_MBps"], 1) for r in rows],
               "kv_MBps": [round(r["kv_MBps"], 1) for r in rows],
               "ratio_per_size": [round(r["ratio"], 2) for r in rows],
               "bulk_over_kv_throughput": round(ratio, 2), "reps": args.reps,
               "goal": "bulk_over_kv_throughput >= 10", "goal_met": bool(ratio >= 10),
               **common.host_info()})


if __name__ == "__main__":
  main()
