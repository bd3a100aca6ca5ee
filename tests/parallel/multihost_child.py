"""One process of the 3-process checks in test_multihost.py (started by launch/local_cluster.py:
processes 0 and 1 are the trainer, 2 a generator; 2 CPU devices each).

    transfer          two pushes of a model's params from the trainer's FSDP mesh (4 devices, 2
                      processes) to the generator's tensor-parallel mesh (2 devices, process 2):
                      the generator checks every value, dtype and shard against its own copy
    generator_raises  the generator process fails while starting a stage: the trainer leader
                      gets the error with its traceback
    trainer_killed    after one push, trainer process 1 kill -9s itself while the others wait
                      for messages; the generator holds a verifier pool (worker processes, whose
                      pids it writes to argv[2]/pids)
    killed_mid_pull   the generator process describes completions on its stream and is kill -9ed
                      while the leader's reader pulls their buffer: the pull fails, the reader
                      loses the generator
    killed_before_pull  the same, but it is dead before the leader connects to pull: that pull
                      never completes, and the reader loses it by its heartbeats
    bulk              parallel.bulk.BulkChannel: processes 1 and 2 each send process 0 messages
                      of arrays (mixed dtypes, empty, 0-d, 20 MB, none) and move on; process 0
                      receives both channels at once, on two threads, a second later, and checks
                      every byte
"""
import multiprocessing
import os
import signal
import sys
import time

import jax
import numpy as np

from magistral_jax.model import transformer as T
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel import multihost
from magistral_jax.parallel.sharding import make_mesh, param_shardings
from magistral_jax.parallel.config import GENERATOR_RULES, TRAINER_RULES
from magistral_jax.parallel import liveness
from magistral_jax.pipeline.errors import PipelineError
from magistral_jax.pipeline.generator_service import in_stream, out_stream, serve_generator
from magistral_jax.pipeline.remote import RemoteGenerator, weight_transfer

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64, param_dtype="float32",
                  dtype="bfloat16")   # serving dtype bf16: the push casts


def host_params(version):
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: version * rng.standard_normal(s.shape).astype(np.float32),
                      T.param_shapes(CFG))


def bulk_messages(sender):
  import ml_dtypes
  rng = np.random.default_rng(sender)
  if sender == 2:
    return [({"x": np.arange(1000 * (i + 1), dtype=np.int32) + i}, i) for i in range(3)]
  return [({"a": rng.standard_normal((3, 4)).astype(np.float32),
            "b": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
            "empty": np.zeros((0, 7), np.int32), "scalar": np.int64(7)}, {"i": 1}),
          ({"big": rng.integers(0, 256, 20 << 20, dtype=np.uint8)}, "big"),
          ({}, "end")]


def bulk(mailbox):
  import threading
  import time
  from magistral_jax.parallel.bulk import BulkChannel
  me = jax.process_index()
  if me != 0:
    channel = BulkChannel(mailbox, f"bulk/{me}", me, 0)
    for arrays, meta in bulk_messages(me):
      channel.send(arrays, meta)
    print(f"OK: sent {channel.sent_bytes} bytes", flush=True)
    mailbox.receive(f"bulk_done/{me}", 120)
    return
  time.sleep(1.0)   # the senders have moved on and dropped their buffers
  errors = []

  def check(sender):
    try:
      channel = BulkChannel(mailbox, f"bulk/{sender}", sender, 0, dst_device=sender - 1)
      for arrays, meta in bulk_messages(sender):
        got, got_meta = channel.receive(120)
        assert got_meta == meta and sorted(got) == sorted(arrays), (got_meta, sorted(got))
        for k, v in arrays.items():
          v = np.asarray(v)
          assert got[k].dtype == v.dtype and got[k].shape == v.shape, (k, got[k].dtype, v.dtype)
          np.testing.assert_array_equal(got[k].reshape(-1).view(np.uint8),
                                        v.reshape(-1).view(np.uint8))
    except BaseException as e:
      errors.append(f"{sender}: {type(e).__name__}: {e}")

  threads = [threading.Thread(target=check, args=(s,)) for s in (1, 2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for s in (1, 2):
    mailbox.send(f"bulk_done/{s}", True)
  assert not errors, errors
  print("OK: received both channels", flush=True)


def _trainers_done(layout, mailbox):
  """The other trainer process stays until the leader is done with the staged weights: its part
  of the staging program runs asynchronously, and a process that exits takes it along."""
  if layout.is_leader:
    mailbox.send("trainers_done", True)
  else:
    mailbox.receive("trainers_done", 300)


def main(scenario, tmp=None):
  multihost.initialize()   # here, not at import: the verifier pool's workers import this module
  if scenario == "bulk":
    return bulk(multihost.Mailbox("test"))
  layout = multihost.ProcessLayout(jax.process_index(), jax.process_count(), (0, 1), (2,))
  gmesh = make_mesh({"tensor": -1}, layout.generator_devices()[0])
  transfer = weight_transfer(CFG, gmesh, GENERATOR_RULES, layout.trainer_devices())
  mailbox = multihost.Mailbox("test")
  if layout.is_trainer:
    tmesh = make_mesh({"fsdp": -1}, layout.trainer_devices())
    shardings = param_shardings(T.param_logical_axes(CFG), tmesh, TRAINER_RULES,
                                T.param_shapes(CFG))

    def on_trainer(version):
      return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]),
                          host_params(version), shardings)

    liveness.stop_on_dead_trainers(multihost.watch(), (0, 1), layout.process_id, 10)
    if scenario in ("transfer", "trainer_killed"):
      for version in ((1, 2) if scenario == "transfer" else (1,)):
        transfer.stage(on_trainer(version), version)
        if layout.is_leader:
          _, uuid = transfer.offer(120)
          mailbox.send(in_stream(0, 1), ("push", version, uuid))
          assert mailbox.receive(out_stream(0, 1), 120) == ("ack", version)
      print("OK: pushed", flush=True)
      _trainers_done(layout, mailbox)
      if scenario == "trainer_killed":
        if layout.is_leader:   # once the generator's pool is up, process 1 dies
          assert mailbox.receive(out_stream(0, 1), 120) == ("ready",)
          mailbox.send("go", True)
        else:
          mailbox.receive("go", 120)
          os.kill(os.getpid(), signal.SIGKILL)
        mailbox.receive("never", 600)   # the liveness watch stops this process first
    elif scenario in ("killed_mid_pull", "killed_before_pull"):
      if layout.is_leader:
        if scenario == "killed_before_pull":
          mailbox.receive("dying", 120)
          time.sleep(2.0)
        gen = RemoteGenerator(mailbox, 0, 2, transfer, multihost.watch(), 10).connect()
        t = time.time()
        while gen.serving and time.time() - t < 120:
          time.sleep(0.1)
        print(f"OK: the leader lost it after {time.time() - t:.1f}s: {gen.lost_reason}",
              flush=True)
        gen.close()
      _trainers_done(layout, mailbox)
    elif scenario == "generator_raises":
      gen = (RemoteGenerator(mailbox, 0, 2, transfer, multihost.watch(), 10).connect()
             if layout.is_leader else None)
      # The staging program is the trainer processes' first collective: its gloo context waits
      # only 30 s for both, and the leader first waits for the generator to start.
      if layout.is_leader:
        mailbox.send("staging", True)
      else:
        mailbox.receive("staging", 300)
      with transfer.lock:
        transfer.stage(on_trainer(1), 0)
        if gen is not None:
          gen.begin_stage(0, None)
      if gen is not None:
        error = None
        try:
          gen.wait_for(("stage", 0), "the stage start", timeout_s=120)
        except PipelineError as e:
          error = e
        gen.close()   # as the run's leader does on its way out (run/train.py)
        if error is not None:
          sys.stdout.write(f"OK: the leader got: {str(error)!r}\n")
          sys.stdout.flush()
      _trainers_done(layout, mailbox)
  elif scenario in ("transfer", "trainer_killed"):
    for version in ((1, 2) if scenario == "transfer" else (1,)):
      kind, v, uuid = mailbox.receive(in_stream(0, 1), 120)
      assert (kind, v) == ("push", version)
      got = transfer.receive(uuid)
      want = host_params(version)
      for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                         jax.tree.leaves(transfer.dst_shardings)):
        assert g.dtype == CFG.jnp_serving_param_dtype and g.sharding == s, (g.dtype, g.sharding)
        for shard in g.addressable_shards:
          np.testing.assert_array_equal(np.asarray(shard.data, np.float32),
                                        w[shard.index].astype(g.dtype).astype(np.float32))
      mailbox.send(out_stream(0, 1), ("ack", version))
    print("OK: received", flush=True)
    if scenario == "trainer_killed":
      from magistral_jax.rewards.config import RewardConfig
      from magistral_jax.verify.pool import VerifierPool
      pool = VerifierPool(1, RewardConfig())
      with open(os.path.join(tmp, "pids"), "w") as f:
        f.write(" ".join(str(p.pid) for p in multiprocessing.active_children()))
      mailbox.send(out_stream(0, 1), ("ready",))
      mailbox.receive("never", 600)
      pool.close()
  elif scenario in ("killed_mid_pull", "killed_before_pull"):
    from magistral_jax.parallel import bulk as bulk_io
    from magistral_jax.pipeline.generator_service import completions_channel
    out = out_stream(0, multihost.incarnation())
    mailbox.send(out, ("ready",))
    channel = completions_channel(mailbox, 0, multihost.incarnation(), 2, 0)
    # Described as BulkChannel.send describes a message, but never offered: the pull waits as
    # it would for a buffer whose process died first.
    _, spec = bulk_io.pack({"tokens": np.arange(8, dtype=np.int32)})
    mailbox.send(out, ("bulk", spec, (None, [], {}), channel._base,
                       bulk_io.transfer_server().address()))
    mailbox.send("dying", True)
    time.sleep(1.0 if scenario == "killed_mid_pull" else 0.0)
    os.kill(os.getpid(), signal.SIGKILL)
  elif scenario == "generator_raises":
    def make_loop(stage, params, version):
      raise RuntimeError("boom: the generator could not start")
    serve_generator(layout, mailbox, incarnation=multihost.incarnation(), make_loop=make_loop,
                    make_eval=None, transfer=transfer)


if __name__ == "__main__":
  main(sys.argv[1], *[a for a in sys.argv[2:3] if not a.startswith("--")])
  multihost.finish()   # the service's host (process 0) leaves last
