"""The step-time model (magistral_jax/analysis/scale_model.py) on hand-computed workloads, and a
smoke test of its projection of the recipes (tools/project_recipes.py; the 3-process run is
bench/scale_model.py's)."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from magistral_jax.analysis import scale_model as M
from magistral_jax.run import footprint
from magistral_jax.model.config import LLAMA_3_2_1B, MISTRAL_SMALL_3_24B

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# 8 kept completions a batch, half the groups dropped: 16 generated, 8 groups of 2.
WORK = M.Workload(n_batch=8, n_mini=4, group_size=2, n_async=16, mode="async",
                  prompt_tokens=6, response_tokens=10, keep=0.5, microbatch_tokens=100,
                  microbatches=2)
RATES = M.Rates(decode_tokens_per_s=80, prefill_tokens_per_s=12, verify_tasks_per_s=8,
                train_tokens_per_s=50, bulk_bytes_per_s=3200, message_s=0.2, push_s=0.5)
LAYOUT = M.Layout(trainer_processes=2)


def test_each_part_takes_what_its_rate_says():
  parts = M.part_seconds(WORK, LAYOUT, RATES)
  assert parts["generation"] == pytest.approx(16 * 10 / 80 + 8 * 6 / 12)   # 2 + 4
  assert parts["scoring"] == pytest.approx(16 / 8)
  # Per optimizer step (2 of them): 200 token slots; the follower holds half of them, 32 bytes
  # a slot: 3200 bytes = 1 s, then its rows description and ack, and half the batch notice.
  assert parts["data"] == pytest.approx(2 * (1.0 + 2.5 * 0.2))
  assert parts["train"] == pytest.approx(2 * 200 / 50)
  assert parts["push"] == pytest.approx(2 * 0.5)


def test_the_pulls_overlap_the_next_step():
  """The trainer waits for a push's staging and offers; the generators' pulls run during its next
  step (data 1.5 s + train 4 s), and only what outlasts it counts."""
  wait = lambda total, w: M.part_seconds(WORK, LAYOUT, dataclasses.replace(
      RATES, push_s=total, push_wait_s=w))["push"] / 2
  assert wait(0.5, 0.1) == pytest.approx(0.1)
  assert wait(5.6, 0.1) == pytest.approx(0.1)
  assert wait(7.6, 0.1) == pytest.approx(0.1 + 2.0)
  assert wait(0.5, None) == pytest.approx(0.5)


def test_async_at_twice_n_batch_takes_as_long_as_the_busiest_resource():
  out = M.step_time(WORK, LAYOUT, RATES)
  assert out["overlap_share"] == 1.0
  assert out["trainer_s"] == pytest.approx(3 + 8 + 1)
  assert out["step_s"] == pytest.approx(12)
  assert out["bottleneck"] == "trainer: train"
  assert out["shares"]["generation"] == pytest.approx(6 / 12)
  slow_gen = dataclasses.replace(RATES, decode_tokens_per_s=8)   # generation 20 + 4 s
  out = M.step_time(WORK, LAYOUT, slow_gen)
  assert (out["step_s"], out["bottleneck"]) == (pytest.approx(24), "generation")


def test_sync_and_a_tight_off_policy_bound_add_generation_to_the_trainer():
  sync = M.step_time(dataclasses.replace(WORK, mode="sync"), LAYOUT, RATES)
  assert sync["step_s"] == pytest.approx(12 + 6)
  half = M.step_time(dataclasses.replace(WORK, n_async=12), LAYOUT, RATES)   # f = 4 / 8
  assert half["overlap_share"] == 0.5
  assert half["step_s"] == pytest.approx(12 + 3)


def test_shared_cores_bound_the_step_by_all_the_cpu_seconds():
  rates = dataclasses.replace(RATES, cores_busy={"generation": 2.0})
  out = M.step_time(WORK, M.Layout(trainer_processes=2, shared_cores=2), rates)
  # 6 s x 2 cores + 2 + 3 + 8 + 1 (one core each) = 26 core-seconds on 2 cores.
  assert out["terms_s"]["shared cores"] == pytest.approx(13)
  assert (out["step_s"], out["bottleneck"]) == (pytest.approx(13), "shared cores")


def test_microbatches_follow_the_lengths_and_padding_when_not_given():
  w = dataclasses.replace(WORK, microbatches=None, padding=0.2)
  # 4 completions x 16 tokens = 64 real tokens, 80 per microbatch at 20 % padding: 1.
  assert w.microbatches_per_step == 1
  assert dataclasses.replace(w, n_mini=8, n_batch=8).microbatches_per_step == 2


def test_the_flop_and_byte_counts_match_the_recorded_h100_figures():
  # bench/train_mfu.py's count: 6 x matmul weights + 6 x L x H x Dh x T; a tied model's head is
  # its embedding (counted once), an untied model's input embedding is only gathered.
  c = LLAMA_3_2_1B
  attn = 6 * c.num_layers * c.num_heads * c.head_dim * 2048
  assert M.train_flops_per_token(c, 2048) == 6 * c.num_params() + attn
  s = MISTRAL_SMALL_3_24B
  assert M.matmul_params(s) == s.num_params() - s.vocab_size * s.hidden_size
  assert M.train_flops_per_token(s, 10, "full") == pytest.approx(
      4 / 3 * M.train_flops_per_token(s, 10))
  # The 1B decode step at batch 256, cache 198 (BENCHMARKS.md "First accelerator run"): 4.40 GB
  # moved; at 0.41 of the H100's 3,350 GB/s, 3.2 ms (recorded: 3.22 ms).
  nbytes = M.decode_step_bytes(c, 256, 198, tensor=1)
  assert nbytes == pytest.approx(4.40e9, rel=0.01)
  assert nbytes / (3350e9 * 0.41) == pytest.approx(3.22e-3, rel=0.02)
  # bench/decode_roofline.py's step, from the weights' real bytes, adds the gathered embedding
  # rows and the KV written to the same count.
  step = M.decode_step_traffic(c, 2 * c.num_params(), 0, 256, 198, 2)
  assert step["bytes_per_step"] == pytest.approx(
      nbytes + 256 * (c.hidden_size * 2 + M.kv_bytes_per_position(c)), abs=1)
  assert step["kv_read_bytes"] == M.kv_bytes_per_position(c) * 256 * 198
  # The vendor's figures, by a substring of jax's device_kind.
  assert M.vendor_peak("NVIDIA H100 80GB HBM3") == (989.0, 3350.0)
  assert M.vendor_peak("cpu") == (None, None)


def _h100(**kw):
  return M.Accelerator("H100", peak_tflops=1000.0, hbm_gbps=1000.0, memory_gib=80.0,
                       chips_per_host=8, mfu=0.5, decode_frac=0.5, stage_gbps=100.0,
                       link_gbps=50.0, transfer_gbps=10.0, verifier_cores=100, **kw)


def test_accelerator_rates_from_the_shape_and_the_chip_figures():
  cfg = MISTRAL_SMALL_3_24B
  cl = M.ClusterLayout(trainer_chips=16, generators=2, gen_chips=8, tensor=4, slots=64,
                       positions_read=1000)
  r = M.accelerator_rates(cfg, WORK, cl, _h100(), verify_core_s=0.5, message_s=0.0,
                          remat="none")
  step = M.decode_step_bytes(cfg, 32, 1000, 4) / (1000e9 * 0.5)
  assert r.decode_tokens_per_s == pytest.approx(2 * 2 * 32 / step)
  assert r.train_tokens_per_s == pytest.approx(16 * 500e12 / M.train_flops_per_token(cfg, 16))
  assert r.verify_tasks_per_s == pytest.approx(200)
  # The push: each generator chip's bytes (2 bytes a param over tensor 4) are staged, half of
  # the FSDP shards from the other host, then both generators' copies (8 chips each) leave the
  # first host at 10 GB/s.
  per_chip = cfg.num_params() * 2 / 4
  stage = per_chip / 100e9 + per_chip * 0.5 / 50e9
  assert r.push_s == pytest.approx(stage + 2 * 8 * per_chip / 10e9)
  assert r.push_wait_s == pytest.approx(stage)   # the rest overlaps the next step
  spread = M.push_seconds(cfg, dataclasses.replace(cl, push="spread"), _h100())
  # One replica's bytes per generator (4 chips), spread over the 2 trainer hosts, then copied
  # across the generator's 2 replicas on its links.
  assert spread == pytest.approx(stage + 2 * 4 * per_chip / (2 * 10e9) + per_chip / 50e9)


def test_slots_that_fit_are_the_most_the_memory_estimate_allows():
  from magistral_jax import config as config_lib
  from magistral_jax.run.footprint import generator_bytes
  from magistral_jax.run.plan import model_from_spec
  from magistral_jax.run.recipes import load_recipe
  run = config_lib.validate(load_recipe("configs/small.py", ROOT))
  cfg = model_from_spec("mistral_small_3_24b", run.model)
  memory = 78 * 2**30
  slots = footprint.slots_that_fit(run, cfg, 8, memory, "cuda")

  def total(n):
    r = dataclasses.replace(run, engine=dataclasses.replace(run.engine,
                                                            max_concurrent_decodes=n))
    return generator_bytes(r, cfg, "cuda", 8)["total"]
  assert 0 < slots < run.engine.max_concurrent_decodes and slots % 2 == 0   # data axis of 2
  assert total(slots) <= memory < total(slots + 2)
  live = footprint.slots_that_fit(run, cfg, 8, memory, "cuda", positions=11_000)   # a quarter
  assert live > 2 * slots


def test_the_tool_projects_medium_and_small_with_each_parts_share():
  r = subprocess.run([sys.executable, os.path.join(ROOT, "tools/project_recipes.py"),
                      "--clusters=128xH100",
                      "--medium_models=mistral_small_3_24b"],
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  rows = out["projections"]
  assert {(x["recipe"], x["stage"]) for x in rows} == {
      ("Medium", "16k"), ("Medium", "24k"), ("Medium", "32k"), ("Small", "rl")}
  recipe = [x for x in rows if x["variant"] == "recipe"]
  assert len(recipe) == 4
  for x in recipe:
    assert x["step_s"] > 0 and set(x["shares"]) == set(M.PARTS)
    assert max(x["shares"].values()) == pytest.approx(1.0, abs=1e-3)   # the bottleneck's
    assert x["bottleneck"]
