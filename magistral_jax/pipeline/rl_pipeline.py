"""The asynchronous RL pipeline of SPEC §5 (single controller), and its synchronous twin.

    prompts -> feeder thread -> generators (own device slices, continuous batching, KV kept
    across weight updates) -> collector -> verifier pool (CPU processes) -> group assembly
    (drop zero-advantage groups; Â = r − mean(group)) -> batch of n_batch completions, fixed
    permutation -> minibatches -> greedy-collated microbatches -> trainer (own slice) -> after each
    optimizer step: device-to-device reshard of the params onto every generator, version v+1.

Async (the paper): generators never wait for the trainer. Two bounds, both enforced by the feeder
(never by the generators):
- `n_async`, the paper's: completions generated in parallel, i.e. submitted to a generator and
  not yet returned by it (running in a slot or queued for one). The feeder keeps it topped up.
- `max_queue`: the bounded blocking queue between generators and trainer, i.e. completions that
  are generated but not yet consumed (being scored, waiting for the rest of their group, or ready
  for the next batch). A prompt is submitted only while generating + queued + G stays within
  n_async + max_queue, so when the trainer falls behind, generation stops running further ahead
  and off-policy lag stays bounded. When the trainer keeps up, the queue never fills and the
  generators always have n_async completions to work on.

Sync (for comparison and ablations): the same code path with a barrier. Exactly enough groups for
one batch are generated under one policy version (topped up if groups are dropped), every
generation finishes, then the trainer runs and pushes, then generation resumes. Tokens in a batch
therefore all carry one version.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from magistral_jax.generate.loop import Completion as GenCompletion, GeneratorLoop, Request
from magistral_jax.model.config import ModelConfig
from magistral_jax.model.tokenizer import MAGISTRAL_SYSTEM_PROMPT
from magistral_jax.rl import advantages as adv_lib
from magistral_jax.rl.collate import Completion as TrainCompletion, make_minibatches
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rewards.reward import RewardResult, failed_result
from magistral_jax.train.step import TrainState, shard_batch

log = logging.getLogger(__name__)

REWARD_PARTS = ("format", "correct", "language", "length_penalty")


class PipelineError(RuntimeError):
  """A component (generator thread, feeder, collector) failed; the cause carries the traceback."""


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  mode: str = "async"        # 'async' (paper) | 'sync' (barrier between phases)
  # Completions generated in parallel (submitted to a generator, not yet returned by it): the
  # paper's n_async (SPEC §4: n_async / n_batch <= 2 for Medium). 0 means 2 * n_batch.
  n_async: int = 0
  # The bounded queue between generators and trainer: generated completions not yet consumed
  # (scoring, waiting for their group, or for a batch). No new prompt is submitted while
  # generating + queued + G would exceed n_async + max_queue. 0 means n_async.
  max_queue: int = 0
  seed: int = 0
  sample_every: int = 0      # log one decoded sample every N steps (0 = never)
  batch_timeout_s: float = 600.0   # a batch that does not fill in this time is an error, not a hang

  def __post_init__(self):
    if self.mode not in ("async", "sync"):
      raise ValueError(f"PipelineConfig.mode must be async|sync, got {self.mode!r}")


@dataclasses.dataclass
class Scored:
  """One completion with its reward, as it travels from the verifiers to the trainer."""
  gen: GenCompletion
  result: RewardResult
  generator: int


class _Group:
  def __init__(self, gid: int, task: dict, size: int):
    self.gid, self.task, self.size = gid, task, size
    self.members: list[Scored] = []
    self.dropped = False


class RLPipeline:
  """Generators + verifier pool + trainer with weight pushes. See the module docstring.

  Args:
    model_cfg, grpo_cfg: the policy and the loss/batching knobs.
    train_step: `step(state, batch) -> (state, metrics)` (train.step.make_grpo_step).
    state: the trainer's TrainState on the trainer mesh.
    trainer_mesh: mesh of the trainer's devices (batches are placed there).
    generators: one GeneratorLoop per generator slice (engine on its own mesh).
    pool: a VerifierPool (or anything with submit(task, response, tokens, seed) -> Future).
    tokenizer: builds prompts (apply_chat_template) and detokenizes responses.
    prompts: iterator of task dicts ({"id", "kind", "problem", "answer", ...}).
    writer: MetricsWriter or None. version: policy version of `state.params`.
    system_prompt: the prompt template ({problem} placeholder); None = the bare problem.
  """

  def __init__(self, *, model_cfg: ModelConfig, grpo_cfg: GRPOConfig, train_step, state: TrainState,
               trainer_mesh, generators: Sequence[GeneratorLoop], pool, tokenizer,
               prompts: Iterator[dict], cfg: PipelineConfig = PipelineConfig(), writer=None,
               version: int = 0, system_prompt: str | None = MAGISTRAL_SYSTEM_PROMPT,
               on_step: Callable[[int, "RLPipeline", dict], None] | None = None,
               rng_seed: int | None = None):
    if not generators:
      raise ValueError("RLPipeline needs at least one generator")
    self.model_cfg, self.grpo_cfg, self.cfg = model_cfg, grpo_cfg, cfg
    self.train_step, self.state, self.trainer_mesh = train_step, state, trainer_mesh
    self.generators = list(generators)
    self.pool, self.tokenizer, self.prompts = pool, tokenizer, prompts
    self.writer, self.version, self.on_step = writer, int(version), on_step
    self.system_prompt = system_prompt
    self.group_size = grpo_cfg.group_size
    if grpo_cfg.n_batch % self.group_size or grpo_cfg.n_mini % self.group_size:
      raise ValueError(f"n_batch={grpo_cfg.n_batch} and n_mini={grpo_cfg.n_mini} must be multiples "
                       f"of group_size={self.group_size}")
    if self.group_size < 2:
      raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {self.group_size}")
    self.n_async = cfg.n_async or 2 * grpo_cfg.n_batch
    self.max_queue = cfg.max_queue or self.n_async
    if cfg.mode == "async":
      if self.n_async < self.group_size:
        raise ValueError(f"n_async={self.n_async} < group_size={self.group_size}: no group could "
                         "ever be submitted")
      if self.max_queue < grpo_cfg.n_batch:
        raise ValueError(f"max_queue={self.max_queue} < n_batch={grpo_cfg.n_batch}: a batch could "
                         "never fill")
    self._rng = np.random.default_rng(cfg.seed if rng_seed is None else rng_seed)
    self._scored: queue.Queue[Scored] = queue.Queue()
    self._generated: queue.Queue[tuple[int, GenCompletion]] = queue.Queue()
    self._groups: dict[int, _Group] = {}
    self._ready: collections.deque[_Group] = collections.deque()
    self._next_gid = 0
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    self._errors: list[tuple[str, BaseException, str]] = []
    self._lock = threading.Lock()
    self._room = threading.Condition(self._lock)   # the feeder waits on it for n_async/queue room
    self._generating = 0        # submitted to a generator, not yet returned: <= n_async
    self._queued = 0            # returned by a generator, not yet consumed or dropped
    self.max_generating = 0     # high-water marks: max_generating <= n_async and
    self.max_inflight = 0       # max_inflight (generating + queued) <= n_async + max_queue
    self.last_pushed: list = [None] * len(generators)
    self._prompts_exhausted = False
    self.opt_steps = 0          # optimizer steps (one per minibatch)
    self.batches = 0
    self.counters = collections.Counter()
    self._verifier_latencies: collections.deque[float] = collections.deque(maxlen=1000)
    self._started = False
    # Groups dropped since the last batch. A batch's reward metrics cover its own groups plus
    # these, so every scored group is counted once, in the batch that consumes (or follows) it.
    self._dropped_since_batch: list[_Group] = []
    self._gen_load = [0] * len(self.generators)   # samples submitted, not yet returned
    for i, g in enumerate(self.generators):
      g.callback = (lambda c, i=i: self._generated.put((i, c)))

  # ---- threads -----------------------------------------------------------------------------
  def start(self):
    if self._started:
      return self
    self._started = True
    self._t0 = time.time()
    self._gen_t0 = [self._gen_counters(g) for g in self.generators]
    for g in self.generators:
      g.start()
    threads = [("collector", self._collect)]
    if self.cfg.mode == "async":
      threads.append(("feeder", self._feed))
    for name, target in threads:
      t = threading.Thread(target=self._guard(name, target), name=f"pipeline-{name}", daemon=True)
      t.start()
      self._threads.append(t)
    return self

  def _guard(self, name, fn):
    def run():
      try:
        fn()
      except BaseException as e:
        self._errors.append((name, e, traceback.format_exc()))
        log.error("pipeline %s failed: %s", name, traceback.format_exc())
    return run

  def check(self):
    """Raises PipelineError if any generator or pipeline thread died (with its traceback)."""
    for g in self.generators:
      try:
        g.check()
      except Exception as e:
        raise PipelineError(f"generator failed: {e}") from e
    if self._errors:
      name, e, tb = self._errors[0]
      raise PipelineError(f"pipeline {name} thread failed:\n{tb}") from e

  def close(self):
    """Stops threads and generators. Safe to call twice; never hangs on a dead component."""
    self._stop.set()
    with self._room:
      self._room.notify_all()   # unblock the feeder
    for t in self._threads:
      t.join(timeout=10)
    for g in self.generators:
      try:
        g.stop(timeout=30)
      except TimeoutError as e:   # a generator stuck in a step: the others still stop
        log.warning("closing the pipeline: %s", e)

  def _next_task(self):
    with self._lock:
      if self._prompts_exhausted:
        return None
      try:
        return next(self.prompts)
      except StopIteration:
        self._prompts_exhausted = True
        return None

  def _submit_group(self) -> bool:
    """Submits the next prompt as a group of G samples to the least-loaded generator."""
    task = self._next_task()
    if task is None:
      return False
    prompt = self.tokenizer.apply_chat_template(task["problem"], self.system_prompt)
    with self._lock:
      gid = self._next_gid
      self._next_gid += 1
      self._groups[gid] = _Group(gid, task, self.group_size)
      self._generating += self.group_size
      self.max_generating = max(self.max_generating, self._generating)
      self.max_inflight = max(self.max_inflight, self._generating + self._queued)
      i = int(np.argmin(self._gen_load))
      self._gen_load[i] += self.group_size
    self.generators[i].submit(Request(id=gid, prompt_tokens=prompt, group_size=self.group_size,
                                      metadata=task, seed=int(self._rng.integers(2**31))))
    return True

  def _has_room(self) -> bool:
    g = self.group_size
    return (self._generating + g <= self.n_async
            and self._generating + self._queued + g <= self.n_async + self.max_queue)

  def _feed(self):
    """Async mode: submits a group whenever n_async and the queue bound have room for G more."""
    while not self._stop.is_set():
      with self._room:
        while not (self._stop.is_set() or self._has_room()):
          self._room.wait(timeout=0.1)
      if self._stop.is_set() or not self._submit_group():
        return

  def _collect(self):
    """Generated completions -> verifier pool; a future's result lands in the scored queue."""
    while not self._stop.is_set():
      try:
        i, c = self._generated.get(timeout=0.05)
      except queue.Empty:
        continue
      with self._room:
        self._gen_load[i] -= 1
        self._generating -= 1
        self._queued += 1
        self._room.notify_all()
      response = self.tokenizer.decode(c.tokens)
      t_submit = time.time()
      try:
        fut = self.pool.submit(c.metadata, response, len(c.tokens), int(c.request_id))
      except Exception as e:   # a closed or broken pool: score 0, keep the run going
        self._scored.put(Scored(c, failed_result(f"verifier submit failed: {e}"), i))
        continue

      def done(f, c=c, i=i, t=t_submit):
        try:
          res = f.result()
        except Exception as e:  # the pool resolves failures itself; this is a last resort
          res = failed_result(f"verifier failed: {type(e).__name__}: {e}")
        self._verifier_latencies.append(time.time() - t)
        self._scored.put(Scored(c, res, i))
      fut.add_done_callback(done)

  # ---- group assembly ------------------------------------------------------------------------
  def _drain_scored(self, timeout: float) -> int:
    """Moves scored completions into their groups; finished groups are filtered into `_ready`."""
    n = 0
    deadline = time.time() + timeout
    while True:
      try:
        s = self._scored.get(timeout=max(0.0, deadline - time.time()) if n == 0 else 0.0)
      except queue.Empty:
        return n
      n += 1
      if s.result.error:
        self.counters["verifier_errors"] += 1
        log.warning("verifier error for group %s sample %s: %s", s.gen.request_id,
                    s.gen.sample_index, s.result.error[:300])
      g = self._groups[int(s.gen.request_id)]
      g.members.append(s)
      if len(g.members) == g.size:
        del self._groups[g.gid]
        # Arrival order depends on thread timing; sample order does not.
        g.members.sort(key=lambda m: m.gen.sample_index)
        self._finish_group(g)

  def _finish_group(self, g: _Group):
    rewards = np.asarray([m.result.reward for m in g.members])
    lp = np.asarray([m.result.parts.get("length_penalty", 0.0) for m in g.members])
    keep, stats = adv_lib.filter_groups(rewards, np.zeros(len(rewards), int), lp,
                                        self.grpo_cfg.length_only_groups, self.grpo_cfg.reward_atol)
    self.counters["groups_scored"] += 1
    g.dropped = not keep.all()
    if g.dropped:
      self._dropped_since_batch.append(g)
      self.counters["groups_dropped"] += 1
      self.counters["groups_zero_advantage"] += stats["groups_zero_advantage"]
      self._release(g.size)
      return
    self._ready.append(g)

  def _release(self, n: int):
    """n queued completions were consumed by the trainer or dropped with their group."""
    with self._room:
      self._queued -= n
      self._room.notify_all()

  # ---- the main loop -------------------------------------------------------------------------
  def _wait_for_batch(self) -> list[_Group]:
    need = self.grpo_cfg.n_batch // self.group_size
    t0 = time.time()

    def tick():
      self.check()
      self._drain_scored(0.05)
      if time.time() - t0 > self.cfg.batch_timeout_s:
        raise PipelineError(
            f"batch did not fill in {self.cfg.batch_timeout_s}s ({len(self._ready)}/{need} groups "
            f"ready; scored {self.counters['groups_scored']} groups, dropped "
            f"{self.counters['groups_dropped']} with zero advantage, "
            f"{self.counters['verifier_errors']} verifier errors)")

    if self.cfg.mode == "sync":
      # Barrier: generate exactly the missing groups under the current version, wait for every
      # one of them to be scored, top up if the filter dropped some.
      while len(self._ready) < need:
        for _ in range(need - len(self._ready)):
          if not self._submit_group():
            break
        if not self._groups and self._prompts_exhausted:
          raise StopIteration
        while self._groups:
          tick()
    else:
      while len(self._ready) < need:
        tick()
        if self._prompts_exhausted and not self._groups and self._scored.empty() \
            and len(self._ready) < need:
          raise StopIteration
    return [self._ready.popleft() for _ in range(need)]

  def _push(self) -> float:
    """Device-to-device reshard of the trainer's params onto every generator (version v+1)."""
    t = time.time()
    for i, g in enumerate(self.generators):
      # may_alias=False: the trainer donates its state next step, so never share its buffers.
      new = jax.device_put(self.state.params, g.engine.param_shardings, may_alias=False)
      jax.block_until_ready(new)
      g.update_params(new, self.version)
      self.last_pushed[i] = new
    return time.time() - t

  def train_on_groups(self, groups: list[_Group]) -> dict:
    """Advantages -> fixed permutation -> minibatches -> one optimizer step + push per minibatch."""
    comps, rows = [], []
    groups = sorted(groups, key=lambda g: g.gid)   # independent of which generator was faster
    for gid, g in enumerate(groups):
      rewards = np.asarray([m.result.reward for m in g.members])
      advs = adv_lib.group_advantages(rewards, np.zeros(len(rewards), int))
      for m, a in zip(g.members, advs):
        comps.append(TrainCompletion(m.gen.prompt_tokens, m.gen.tokens, m.gen.logprobs, float(a), gid))
        rows.append(m)
    # Completions go to data-parallel ranks by a fixed (seeded per batch) permutation of groups.
    perm_rng = np.random.default_rng([self.cfg.seed, self.batches])
    minibatches = make_minibatches(comps, self.grpo_cfg, perm_rng, min_microbatches=0)
    metrics_acc = collections.defaultdict(list)
    push_s = 0.0
    for arrays, _placement, stats, _idx in minibatches:
      batch = shard_batch(arrays, self.trainer_mesh)
      self.state, m = self.train_step(self.state, batch)
      m = jax.device_get(m)
      self.opt_steps += 1
      self.version += 1
      push_s += self._push()
      for k, v in m.items():
        metrics_acc[k].append(float(np.asarray(v)))
      metrics_acc["padding_frac"].append(stats["padding_frac"])
      metrics_acc["microbatches"].append(stats["microbatches"])
    out = {k: float(np.mean(v)) for k, v in metrics_acc.items()}
    out["weight_push_s"] = push_s / max(1, len(minibatches))
    # Off-policy accounting: lag of every token relative to the version that trains on it.
    trained_version = self.version - len(minibatches)
    versions = np.concatenate([np.asarray(m.gen.versions) for m in rows])
    lag = trained_version - versions
    out.update(version_lag_max=float(lag.max()), version_lag_mean=float(lag.mean()),
               versions_in_batch=float(len(np.unique(versions))))
    self.last_batch_versions = np.unique(versions)
    return out

  def _batch_reward_metrics(self, groups_window: list[_Group]) -> dict:
    members = [m for g in groups_window for m in g.members]
    if not members:
      return {}
    r = np.asarray([m.result.reward for m in members])
    out = {"reward": float(r.mean()), "reward_max": float(r.max())}
    for p in REWARD_PARTS:
      out[f"reward_{p}"] = float(np.mean([m.result.parts.get(p, 0.0) or 0.0 for m in members]))
    out["accuracy"] = float(np.mean([(m.result.parts.get("correct") or 0) > 0 for m in members]))
    out["format_rate"] = float(np.mean([(m.result.parts.get("format") or 0) > 0 for m in members]))
    lens = np.asarray([len(m.gen.tokens) for m in members])
    out.update(response_length_mean=float(lens.mean()), response_length_max=float(lens.max()))
    return out

  def run(self, num_batches: int) -> list[dict]:
    """Runs `num_batches` training batches (n_batch/n_mini optimizer steps each). Returns the
    per-batch metrics. Stops early (cleanly) when the prompts run out."""
    history = []
    self.start()
    try:
      for _ in range(num_batches):
        t_wait = time.time()
        try:
          groups = self._wait_for_batch()
        except StopIteration:
          log.info("prompts exhausted after %d batches", self.batches)
          break
        wait_s = time.time() - t_wait
        # Not "groups scored since the last batch": when generation runs ahead, a batch's groups
        # may all have been scored before the previous batch, which left its metrics empty.
        window, self._dropped_since_batch = self._dropped_since_batch + groups, []
        t_train = time.time()
        m = self.train_on_groups(groups)
        train_s = time.time() - t_train
        self._release(sum(g.size for g in groups))
        self.batches += 1
        m.update(self._batch_reward_metrics(window))
        m["filtered_group_frac"] = float(np.mean([g.dropped for g in window]))
        m.update(self._system_metrics(wait_s, train_s))
        m["batch"] = self.batches
        m["version"] = self.version
        history.append(m)
        if self.writer is not None:
          self.writer.write(self.opt_steps, m)
          if self.cfg.sample_every and self.batches % self.cfg.sample_every == 0:
            s = groups[0].members[0]
            task = s.gen.metadata or {}
            self.writer.write_text(
                self.opt_steps, "sample",
                f"problem: {task.get('problem', '?')}\nreference: {task.get('answer', '?')}\n"
                f"reward={s.result.reward:.3f} policy versions {min(s.gen.versions, default=-1)}"
                f"..{max(s.gen.versions, default=-1)}\n" + self.tokenizer.decode(s.gen.tokens))
        if self.on_step is not None:
          self.on_step(self.opt_steps, self, m)
    finally:
      self.close()
    return history

  @staticmethod
  def _gen_counters(g: GeneratorLoop) -> tuple:
    return g.decode_time_s, g.steps, g.active_slot_steps, g.idle_time_s

  def _system_metrics(self, wait_s: float, train_s: float) -> dict:
    now = time.time()
    wall = max(1e-9, now - getattr(self, "_last_t", self._t0))
    self._last_t = now
    util, occ, decode_frac = [], [], []
    for i, g in enumerate(self.generators):
      d0, s0, a0, i0 = self._gen_t0[i]
      steps = g.steps - s0
      occ.append((g.active_slot_steps - a0) / max(1, steps * g.engine.max_concurrent_decodes))
      working = max(0.0, 1.0 - (g.idle_time_s - i0) / wall)
      util.append(occ[-1] * working)
      decode_frac.append(min(1.0, (g.decode_time_s - d0) / wall))
      self._gen_t0[i] = self._gen_counters(g)
    lat = list(self._verifier_latencies)
    return {
        # Share of generator capacity holding live sequences: slot occupancy over decode steps x
        # share of wall time the loop was not waiting for work (it was decoding, prefilling,
        # inserting or doing its bookkeeping). Sync mode loses both while it waits for the
        # longest completion and for the trainer.
        "generator_utilization": float(np.mean(util)),
        "generator_slot_occupancy": float(np.mean(occ)),
        # Share of wall time inside decode steps (the rest is prefill/insert, host work, idle)
        # and the stricter occupancy x decode share.
        "generator_decode_frac": float(np.mean(decode_frac)),
        "generator_decode_utilization": float(np.mean([o * d for o, d in zip(occ, decode_frac)])),
        "trainer_idle_s": wait_s, "trainer_idle_frac": wait_s / max(1e-9, wait_s + train_s),
        "train_time_s": train_s,
        "verifier_latency_s": float(np.mean(lat)) if lat else 0.0,
        "verifier_errors": float(self.counters["verifier_errors"]),
        # Requests whose prompt continued the cached system-prompt prefix (GeneratorLoop
        # shared_prefix), over the run so far, all generators.
        "generator_shared_prefix_hits": float(sum(g.shared_prefix_hits for g in self.generators)),
        "generating_completions": float(self._generating),
        "queued_completions": float(self._queued),
    }
