"""The RL loop end to end on 8 simulated devices (Rollouts + Trainer + rl_loop.train): trainer on
4, two generators on 2 each, the real verifier pool, the real math verifier, a tiny model
warm-started by SFT on the synthetic task. The colocated layout (one generator on the trainer's
own device, taking turns with it) against the disaggregated one at the end."""
import json
import logging
import os
import time
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest

from magistral_jax.data import synthetic
from magistral_jax.generate.config import EngineConfig, SamplingConfig
from magistral_jax.generate.tool_turns import ToolTurns
from magistral_jax.model import transformer as T
from magistral_jax.model.char_tokenizer import char_tokenizer
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.config import TRAINER_RULES
from magistral_jax.parallel.sharding import make_mesh
from magistral_jax.parallel.memory import bytes_in_use
from magistral_jax.pipeline.config import PipelineConfig
from magistral_jax.pipeline.errors import PipelineError
from magistral_jax.pipeline.rollouts import Rollouts
from magistral_jax.parallel.layout import split_devices
from magistral_jax.train.sft import sft_warm_start
from magistral_jax.pipeline.generators import make_generators
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.tool_run import ToolRunner
from magistral_jax.rl.collate import unpack_tokens
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.tool_use.config import ToolConfig
from magistral_jax.tool_use.protocol import result_block
from magistral_jax.train.metrics_writer import MetricsWriter
from magistral_jax.train.optimizer import make_optimizer
from magistral_jax.train.config import OptimizerConfig, SFTConfig
from magistral_jax.train.sft import make_sft_step
from magistral_jax.train.rl_loop import Trainer, train
from magistral_jax.train.step import init_state, make_grpo_step
from magistral_jax.verify.pool import VerifierPool

GRPO = GRPOConfig(n_batch=16, n_mini=8, group_size=4, microbatch_tokens=1024, microbatch_rows=4)
MAX_NEW = 40


@pytest.fixture(scope="module")
def setup():
  tok = char_tokenizer()
  cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    eos_token_id=tok.eos_id, bos_token_id=tok.bos_id)
  tdev, gdevs = split_devices(4, [2, 2])
  tmesh = make_mesh({"fsdp": 4}, tdev)
  tx = make_optimizer(OptimizerConfig(learning_rate=3e-3))
  state = init_state(cfg, tx, jax.random.PRNGKey(0), tmesh, TRAINER_RULES)
  examples = ((p["problem"], synthetic.trace(p)) for p in synthetic.problems(0))
  state, _ = sft_warm_start(state, make_sft_step(cfg, tx, tmesh, TRAINER_RULES), tok, examples,
                            SFTConfig(num_steps=80, batch_size=16, row_len=512, rows_per_micro=4),
                            system_prompt=synthetic.TINY_SYSTEM_PROMPT, mesh=tmesh)
  params = jax.device_get(state.params)
  pool = VerifierPool(1, RewardConfig(l_max=MAX_NEW, l_cache=16), task_timeout_s=20)
  yield dict(tok=tok, cfg=cfg, tmesh=tmesh, gdevs=gdevs, params=params, pool=pool)
  pool.close()


class Run:
  """One RL run's parts: the Trainer, the Rollouts, and the loop over them."""

  def __init__(self, s, mode, workdir=None, n_async=0, seed=1, pool=None, max_queue=0,
               tune=False, tmesh=None, gdevs=None, colocated=False, tx=None, carry_over=False,
               tools=None, **engine):
    rl_tx = tx or make_optimizer(OptimizerConfig(learning_rate=1e-3))
    tmesh = tmesh or s["tmesh"]
    state = init_state(s["cfg"], rl_tx, jax.random.PRNGKey(0), tmesh, TRAINER_RULES,
                       params=s["params"])
    self.trainer = Trainer(make_grpo_step(s["cfg"], GRPO, rl_tx, tmesh, TRAINER_RULES),
                           state, tmesh, TRAINER_RULES)
    gens = make_generators(s["cfg"], s["params"], gdevs or s["gdevs"],
                           SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW,
                                          eos_id=s["tok"].eos_id),
                           EngineConfig(max_concurrent_decodes=8, max_prefill_length=64,
                                        tune=tune,
                                        background_prefill=not (colocated and (
                                            mode == "sync" or carry_over)),
                                        **engine),
                           seed=seed, tools=tools)
    self.rollouts = Rollouts(generators=gens, pool=pool or s["pool"], tokenizer=s["tok"],
                             prompts=synthetic.problems(seed), grpo_cfg=GRPO,
                             cfg=PipelineConfig(mode=mode, n_async=n_async, max_queue=max_queue,
                                                batch_timeout_s=300, carry_over=carry_over),
                             system_prompt=synthetic.TINY_SYSTEM_PROMPT, seed=seed,
                             colocated=colocated)
    self.writer = MetricsWriter(workdir) if workdir else None
    self.on_batch = None

  def run(self, num_batches):
    with self.rollouts:
      return train(self.trainer, self.rollouts, GRPO, num_batches, seed=1, writer=self.writer,
                   on_batch=self.on_batch)


def test_async_pipeline_end_to_end(setup, tmp_path):
  run = Run(setup, "async", str(tmp_path), n_async=32, tune=True)
  pipe = run.rollouts
  # make_generators tuned each engine's CPU dot library, its drain engines' too
  # (xla_cpu.tune_engine).
  for gen in pipe.generators:
    engines = [gen.engine] + [gen.engine.compact_engine(n) for n in gen.engine.compact_sizes]
    assert all(e.generate_tuning["chosen"] == e.generate_library for e in engines)
  history = run.run(3)
  assert len(history) == 3 and run.trainer.opt_steps == 3 * GRPO.num_minibatches
  assert run.trainer.version == 3 * GRPO.num_minibatches
  # Off-policy: in async mode generation runs ahead of the trainer, so some trained tokens were
  # sampled by an older policy version. (Whether one batch mixes versions depends on how fast the
  # generators are against the trainer on the host: with the paper's bound and a slow trainer a
  # whole batch may come from one older version.)
  assert max(h["version_lag_max"] for h in history) >= 1
  assert all(h["versions_in_batch"] >= 1 for h in history)
  # The paper's bound (the default, max_queue = 0): never more than n_async completions generated
  # and not yet trained on.
  assert 0 < pipe.max_generating <= pipe.max_inflight <= 32
  for key in ("reward", "reward_format", "reward_correct", "reward_length_penalty", "accuracy",
              "format_rate", "response_length_mean", "response_length_max", "entropy",
              "clip_low_frac", "clip_high_frac", "filtered_group_frac", "generator_utilization",
              "generator_slot_occupancy", "generator_decode_utilization",
              "trainer_idle_s", "verifier_latency_s", "weight_push_s", "version_lag_mean",
              "version_lag_hist_0", "version_lag_hist_3plus", "groups_verifier_error"):
    assert all(key in h and np.isfinite(h[key]) for h in history), key
  # After a push, each generator holds the trainer's weights bitwise, on its own devices.
  trainer = jax.device_get(run.trainer.state.params)
  for i, g in enumerate(pipe.generators):
    # What the generator decodes with (its engine's per-layer decode layout) is the same weights,
    # on its own devices.
    held = g.weights.pending[0] if g.weights.pending is not None else g.params
    assert T.is_decode_layout(held)
    assert jax.tree.leaves(held)[0].sharding.device_set == set(setup["gdevs"][i])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b),
                 T.to_stacked_layout(held), trainer)
  # Metrics on disk: JSONL rows and TensorBoard event files.
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert len(rows) == 3 and "reward" in rows[0]
  assert any(f.startswith("events") for f in os.listdir(tmp_path / "tb"))


def test_sync_pipeline_trains_on_exactly_one_version(setup):
  run = Run(setup, "sync")
  pipe = run.rollouts
  history = run.run(2)
  assert len(history) == 2
  for h in history:
    assert h["versions_in_batch"] == 1 and h["version_lag_max"] == 0
  assert pipe.max_inflight <= GRPO.n_batch + GRPO.n_batch  # top-ups only replace dropped groups


def test_the_sync_pipeline_on_paged_generators_with_a_pool_that_runs_dry(setup):
  """engine.kv_cache="paged" with 2 slots' worth of pages under 8 slots: generators park and
  resume samples, and the run trains on complete, on-policy batches."""
  run = Run(setup, "sync", kv_cache="paged", page_size=16,
            kv_pages=2 * -(-(64 + MAX_NEW) // 16) + 1)
  history = run.run(1)
  assert len(history) == 1 and history[0]["versions_in_batch"] == 1
  assert history[0]["generator_kv_preemptions"] > 0
  assert history[0]["generator_kv_pages_peak"] <= 2 * -(-(64 + MAX_NEW) // 16)


def test_queue_bound_holds_when_the_trainer_is_slow(setup):
  # A trainer much slower than generation, and the bound loosened by max_queue: the generated,
  # untrained completions fill n_async + max_queue and the feeder stops submitting, so
  # generation never runs further ahead.
  run = Run(setup, "async", n_async=8, max_queue=16)
  pipe = run.rollouts
  real = run.trainer.step_fn

  def slow_step(state, batch):
    time.sleep(1.5)
    return real(state, batch)
  run.trainer.step_fn = slow_step
  seen = []
  run.on_batch = lambda *_: seen.append((pipe._generating, pipe._queued))
  assert len(run.run(2)) == 2
  assert pipe.max_generating <= 8
  assert pipe.max_inflight <= 8 + 16
  assert pipe.max_inflight > 16   # the queue did fill up while the trainer slept
  assert all(g <= 8 and g + q <= 24 for g, q in seen)


def test_pipeline_rejects_bounds_that_could_never_fill_a_batch():
  with pytest.raises(ValueError, match=r"n_async \+ max_queue = 12 < n_batch=16"):
    PipelineConfig(n_async=8, max_queue=4).bounds(GRPO)
  with pytest.raises(ValueError, match="n_async=2 < group_size=4"):
    PipelineConfig(n_async=2).bounds(GRPO)
  # The paper's bound by default: n_async = 2 * n_batch, nothing more.
  assert PipelineConfig().bounds(GRPO) == (2 * GRPO.n_batch, 0)
  assert PipelineConfig(n_async=8, max_queue=8).bounds(GRPO) == (8, 8)
  with pytest.raises(ValueError, match="pipeline.mode must be async|sync"):
    PipelineConfig(mode="barrier")


def test_rollouts_refuse_generators_whose_longest_sequence_overflows_a_row():
  # GRPO's rows hold 1024 / 4 = 256 tokens; a generator's limits bound every sample it returns.
  def gen(max_prefill_length, max_decode_length):
    return SimpleNamespace(engine=SimpleNamespace(max_prefill_length=max_prefill_length,
                                                  max_decode_length=max_decode_length))
  kw = dict(pool=None, tokenizer=None, prompts=iter(()), grpo_cfg=GRPO)
  Rollouts(generators=[gen(64, 193), gen(200, 57)], **kw)   # 256 tokens: a row exactly
  with pytest.raises(ValueError, match=r"64 prompt tokens \+ sampling.max_new_tokens=194 - 1 = "
                                       r"257 packed tokens, does not fit a microbatch row"):
    Rollouts(generators=[gen(64, 40), gen(64, 194)], **kw)


def test_generator_thread_failure_surfaces_without_hanging(setup):
  run = Run(setup, "async", n_async=32)
  pipe = run.rollouts
  g = pipe.generators[1]
  real_step, calls = g.step, [0]

  def failing_step():
    calls[0] += 1
    if calls[0] > 5:
      raise RuntimeError("boom: simulated generator fault")
    return real_step()
  g.step = failing_step
  t = time.time()
  with pytest.raises(PipelineError, match="boom"):
    run.run(50)
  assert time.time() - t < 200
  # Clean stop: no pipeline or generator thread is left running.
  assert not any(th.is_alive() for th in pipe._threads)
  assert all(gen._thread is None for gen in pipe.generators)


class _FlakyPool:
  """Delegates to the real pool but fails every tenth submission, like a lost verifier host."""

  def __init__(self, pool):
    self.pool, self.n = pool, 0

  def submit(self, *args):
    self.n += 1
    if self.n % 10 == 0:
      raise ConnectionError("verifier host unreachable")
    return self.pool.submit(*args)


def test_verifier_failures_drop_their_group_and_the_run_continues(setup):
  run = Run(setup, "async", n_async=32, pool=_FlakyPool(setup["pool"]))
  pipe = run.rollouts
  history = run.run(2)
  assert len(history) == 2
  assert pipe.counters["verifier_errors"] > 0
  assert pipe.counters["groups_verifier_error"] > 0   # their groups dropped, not trained on


def _colocated_layouts():
  """The trainer on device 0; a generator on the same device (colocated) or on device 1.
  One device, the colocated layout users run: colocated over two simulated CPU devices, a train
  step now and then deadlocked in XLA:CPU's runtime, each device waiting in a different
  all-gather of the same launch (docs/design_notes.md, "Hangs on the simulated devices"). The
  trainer's FSDP over several devices is tested by the other tests of this file (4 devices)."""
  devs = jax.devices()
  return make_mesh({"fsdp": 1}, devs[:1]), [devs[:1]], [devs[1:2]]


def test_colocated_step_equals_the_disaggregated_step(setup):
  # Same seeds, the sync schedule, engines of the same shape: the generator on the trainer's
  # devices samples the same completions as one on devices of its own, so the batch is the same
  # and so are the params after its optimizer steps. Not bit for bit: a dropped group's
  # replacement joins the slots when its scores arrive, so prompts share a prefill batch
  # differently and the log-probs can differ in the last bit. Plain SGD, so that such a
  # difference stays as small in the params as in the gradient: Adam divides each update by
  # sqrt(v), and where a gradient is near zero a last-bit difference became a 5e-6 one in CI.
  tmesh, colocated_devs, own_devs = _colocated_layouts()
  results = {}
  for name, gdevs in (("disaggregated", own_devs), ("colocated", colocated_devs)):
    run = Run(setup, "sync", tmesh=tmesh, gdevs=gdevs, colocated=name == "colocated",
              tx=optax.sgd(0.1))
    tokens = []
    real_take = run.rollouts._groups.take

    def take(*a, real_take=real_take, tokens=tokens):
      batch = real_take(*a)
      tokens.append([c.completion_tokens.tolist() for g in batch.groups for c in g.completions])
      return batch
    run.rollouts._groups.take = take
    history = run.run(1)
    assert len(history) == 1 and run.trainer.opt_steps == GRPO.num_minibatches
    results[name] = (tokens, jax.device_get(run.trainer.state.params), history[0])
  (tok_d, params_d, h_d), (tok_c, params_c, h_c) = results["disaggregated"], results["colocated"]
  assert tok_d == tok_c and len(tok_d[0]) == GRPO.n_batch
  moved = max(float(np.abs(d - p).max())
              for d, p in zip(jax.tree.leaves(params_d), jax.tree.leaves(setup["params"])))
  assert moved > 1e-3    # the steps changed the params far beyond the tolerance below
  jax.tree.map(lambda c, d: np.testing.assert_allclose(c, d, rtol=0, atol=1e-6), params_c,
               params_d)
  assert h_c["reward"] == h_d["reward"]
  # Colocated pushes move nothing (the next phase loads the params where they are).
  assert h_c["weight_push_s"] == 0.0 and h_d["weight_push_s"] > 0.0


def test_colocated_generation_frees_its_kv_cache_and_weights_before_each_train_step(setup):
  tmesh, colocated_devs, _ = _colocated_layouts()
  run = Run(setup, "sync", tmesh=tmesh, gdevs=colocated_devs, colocated=True)
  gen = run.rollouts.generators[0]
  kv_bytes = sum(x.nbytes for x in jax.tree.leaves(gen.state.cache))
  cache_shapes = {x.shape for x in jax.tree.leaves(gen.state.cache)}
  weights_bytes = sum(x.nbytes for x in jax.tree.leaves(gen.params))
  assert kv_bytes > 0
  real, seen = run.trainer.step_fn, []
  devices = list(tmesh.devices.flat)

  def kv_cache_bytes_alive():
    return sum(a.nbytes for a in jax.live_arrays()
               if a.shape in cache_shapes and a.sharding.device_set & set(devices))

  def step(state, batch):
    # What the devices hold as the train step starts: nothing of the generator's.
    seen.append((gen.released, kv_cache_bytes_alive(), bytes_in_use(devices)))
    return real(state, batch)
  step.lower = real.lower   # the compiled step's own memory account (Trainer.step)
  run.trainer.step_fn = step
  history = run.run(2)
  assert len(history) == 2 and len(seen) == 2 * GRPO.num_minibatches
  assert all(released and kv == 0 for released, kv, _ in seen), seen
  for h in history:
    # The release freed the cache and the weights copy (and the shared prefix's cache, if any).
    assert h["memory/generation_released_bytes"] >= kv_bytes + weights_bytes
    assert h["memory/generate_peak_bytes"] >= kv_bytes + weights_bytes
    assert h["memory/train_peak_bytes"] > max(b for _, _, b in seen)   # + the step's temporaries
    assert h["weight_reload_s"] > 0
  # The second generation phase reloaded the trainer's newest params (version = optimizer steps).
  assert gen.version == GRPO.num_minibatches and history[1]["versions_in_batch"] == 1
  assert kv_cache_bytes_alive() == 0   # after the run too: between phases


def test_colocated_phases_carry_unfinished_samples_over_instead_of_draining(setup):
  """pipeline.carry_over: colocated async taking turns, a phase ending once its batch is ready;
  the samples still generating go on in the next phase under the new weights (their earlier
  tokens keep their version), and the KV cache is gone during every train step."""
  tmesh, colocated_devs, _ = _colocated_layouts()
  run = Run(setup, "async", tmesh=tmesh, gdevs=colocated_devs, colocated=True,
            n_async=2 * GRPO.n_batch, carry_over=True)
  gen = run.rollouts.generators[0]
  real, seen = run.trainer.step_fn, []

  def step(state, batch):
    seen.append(gen.released)
    return real(state, batch)
  step.lower = real.lower
  run.trainer.step_fn = step
  history = run.run(3)
  assert len(history) == 3 and all(seen)
  assert all(h["generation_phase_s"] > 0 for h in history)
  assert max(h["carried_samples"] for h in history) > 0
  assert max(h["version_lag_max"] for h in history) >= 1   # carried samples: older versions


def test_colocated_over_several_cpu_devices_warns_of_the_xla_cpu_deadlock(setup, caplog):
  devs = jax.devices()
  with caplog.at_level(logging.WARNING, logger="magistral_jax.pipeline.taking_turns"):
    Run(setup, "sync", tmesh=make_mesh({"fsdp": 2}, devs[:2]), gdevs=[devs[:2]], colocated=True)
  assert "colocated on 2 CPU devices: XLA:CPU can deadlock" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="magistral_jax.pipeline.taking_turns"):
    tmesh, colocated_devs, _ = _colocated_layouts()
    Run(setup, "sync", tmesh=tmesh, gdevs=colocated_devs, colocated=True)
  assert "XLA:CPU can deadlock" not in caplog.text


def test_a_released_colocated_generator_needs_a_push_before_it_generates(setup):
  tmesh, colocated_devs, _ = _colocated_layouts()
  run = Run(setup, "sync", tmesh=tmesh, gdevs=colocated_devs, colocated=True)
  with run.rollouts as pipe:
    assert pipe.next_batch() is not None
    assert pipe.generators[0].released
    with pytest.raises(PipelineError, match="no push has brought new ones"):
      pipe.next_batch()


class _CallsAfterFour(ToolTurns):
  """The tiny model writes no tags: the first turn of each sample "is" a call once it has four
  tokens (parsing the tags: tests/tool_use/test_protocol.py)."""

  def call_in(self, turn):
    return "print(6 * 7)" if len(turn) >= 4 else None

  def maybe_call(self, slots, slot):
    return slots.results(slot) == 0 and super().maybe_call(slots, slot)


@pytest.mark.parametrize("layout", ["colocated", "one_host"])
def test_tool_calls_round_trip_through_the_sandbox_the_verifier_and_the_loss(setup, layout):
  """Each sample calls the real sandboxed interpreter mid-sequence, reads its result and goes
  on; the batch trains with the result tokens out of the loss. Colocated (the generator takes
  turns with the trainer on its device, sync) and on one host (the trainer on 4 devices, two
  generators on 2 each, async, weights pushed device to device while samples wait for calls).
  Three processes: tests/launch/test_multihost_run.py."""
  tok = setup["tok"]
  cfg = ToolConfig(enabled=True, max_result_tokens=40, cpu_s=1.0)
  runner = ToolRunner(cfg)
  tools = lambda: _CallsAfterFour(cfg, runner, lambda t: tok.encode(t), tok.decode)
  if layout == "colocated":
    tmesh, colocated_devs, _ = _colocated_layouts()
    run = Run(setup, "sync", tmesh=tmesh, gdevs=colocated_devs, colocated=True, tools=tools)
  else:
    run = Run(setup, "async", n_async=2 * GRPO.n_batch, tools=tools)
  packed = []
  real = run.rollouts.minibatches

  def spy(batch, cfg_, rng):
    out = real(batch, cfg_, rng)
    packed.extend(out)
    return out
  run.rollouts.minibatches = spy
  history = run.run(2)
  assert len(history) == 2 and all(np.isfinite(h["loss"]) for h in history)
  assert history[-1]["generator_tool_calls"] >= 2 * GRPO.n_batch
  assert history[-1]["generator_tool_errors"] == 0
  assert all(h["tool_calls_per_sample"] == 1.0 and h["tool_result_tokens_mean"] > 0
             for h in history)
  block = tok.encode(result_block("42\n", cfg.max_output_chars))
  called = [c for mb in packed for c in mb.completions if c.action_mask is not None]
  assert called and all(c.completion_tokens[4:4 + len(block)].tolist() == block for c in called)
  for mb in packed:   # the result tokens are in the rows, and out of the loss (all of a void turn's)
    for c, mask in zip(mb.completions, unpack_tokens(mb.arrays["loss_mask"], mb.completions,
                                                     mb.placement)):
      assert mask.tolist() == (c.actions * c.trained).astype(float).tolist()
  assert all(0.0 <= h["void_turn_frac"] <= 1.0 for h in history)
