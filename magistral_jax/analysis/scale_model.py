"""A model of one RL step's time: the seconds of each part of one batch, and the step time under
the pipeline's overlap, from the rates of the parts (issue #54; bench/scale_model.py measures
them and checks the model against a real run).

One step is one batch (train/rl_loop.py). The generators produce the batch's completions,
n_batch / keep of them (groups whose rewards are all equal are dropped, paper §1, so only `keep`
of the generated ones train); the verifiers score them; then, for each of the n_batch / n_mini
optimizer steps, the leader sends every other trainer process its rows, the trainer steps, and it
pushes the new weights to every generator (paper §5). Five parts:

  generation  completions x response tokens / decode tokens/s
              + groups x prompt tokens / prefill tokens/s      (a group's prompt is prefilled once)
  scoring     completions / verified tasks/s
  data        per optimizer step: the followers' share of the packed rows / bulk bytes/s
              + its messages (each follower's rows description and ack, the batch notice)
              x one message's latency
  train       per optimizer step: packed token slots (padding included) / train tokens/s
  push        per optimizer step: what the trainer waits for of the push to every generator
              (the stage and the offers; the pulls overlap its next step, see below)

How they overlap (pipeline/rollouts.py). Data, train and push run one after another on the
trainer: the leader sends the rows, steps, then stages the new weights and offers them; each
generator pulls its copy while the trainer takes its next step, and the acks are awaited only
before the next push (pipeline/trainer_rollouts.py). So the trainer is busy for their sum, the
push counting its staging and offers plus whatever of the pulls outlasts the next step's data and
train. Generation and scoring run beside it. In async mode the generators never wait
for the trainer and the verifiers score each completion as it arrives, as far as the off-policy
bound allows: at most n_async completions are generating or waiting, and the batch being trained
holds n_batch of them. So while the trainer works, the generators can make the next batch's
n_async - n_batch kept completions (dropped groups leave the bound at once): a share
f = clip((n_async - n_batch) / n_batch, 0, 1) of the next batch overlaps training, the rest comes
after it:

    step = max(generation, scoring, trainer + (1 - f) x generation)

At the paper's n_async = 2 n_batch (f = 1) a step takes as long as its busiest resource; sync mode
(f = 0) waits for the whole generation, then trains. Scoring keeps pace with generation (each
completion is scored while others decode), so it sets the step only when it is the slowest.

Shared cores. Where every part runs on the same CPU cores (the 3-process CPU run: all processes
on one 2-core host), overlapping parts share them, so the step also takes at least all the parts'
CPU seconds / cores: step = max(the above, sum of part seconds x its cores busy / cores).

The pure functions here take rates; `accelerator_rates` derives them for a model shape on named
accelerators from per-chip figures (bench/scale_model.py says which are measured, recorded or
assumed).
"""
from __future__ import annotations

import dataclasses
import math

PARTS = ("generation", "scoring", "data", "train", "push")
TRAINER_PARTS = ("data", "train", "push")
# The packed minibatch arrays (rl/collate.py): tokens, positions, segment_ids, targets, loss_mask,
# old_logprobs, advantages, weights; 4 bytes each per token slot.
BYTES_PER_TOKEN_SLOT = 8 * 4


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one batch holds. Lengths are means, in tokens; `keep` is the share of generated groups
  that are kept (trained on); `padding` the share of packed token slots left empty by collation.
  `microbatches` per optimizer step: None computes it from the lengths and padding."""
  n_batch: int
  n_mini: int
  group_size: int
  n_async: int
  mode: str
  prompt_tokens: float
  response_tokens: float
  keep: float
  microbatch_tokens: int
  padding: float = 0.0
  microbatches: int | None = None

  def __post_init__(self):
    if self.mode not in ("async", "sync"):
      raise ValueError(f"mode {self.mode!r}: async or sync")
    if not 0 < self.keep <= 1 or not 0 <= self.padding < 1:
      raise ValueError(f"keep {self.keep} must be in (0, 1], padding {self.padding} in [0, 1)")
    if self.n_batch % self.n_mini:
      raise ValueError(f"n_batch {self.n_batch} is not a multiple of n_mini {self.n_mini}")

  @property
  def completions(self) -> float:
    """Completions generated (and scored) per batch."""
    return self.n_batch / self.keep

  @property
  def optimizer_steps(self) -> int:
    return self.n_batch // self.n_mini

  @property
  def microbatches_per_step(self) -> int:
    if self.microbatches is not None:
      return self.microbatches
    tokens = self.n_mini * (self.prompt_tokens + self.response_tokens)
    return max(1, math.ceil(tokens / (self.microbatch_tokens * (1.0 - self.padding))))

  @property
  def slots_per_step(self) -> int:
    """Packed token slots of one optimizer step, padding included."""
    return self.microbatches_per_step * self.microbatch_tokens


@dataclasses.dataclass(frozen=True)
class Layout:
  """Trainer processes (the leader and its followers), and `shared_cores`: the host's core count
  when every part runs on one host's cores (None: each part on its own devices)."""
  trainer_processes: int
  shared_cores: int | None = None

  @property
  def followers(self) -> int:
    return self.trainer_processes - 1


@dataclasses.dataclass(frozen=True)
class Rates:
  """The rates of the parts. decode / prefill: all generators together (prefill None: included
  in the decode rate, as an end-to-end measurement of completion tokens/s includes it). push_s:
  one optimizer step's push to every generator, messages and acks included; push_wait_s: the
  part of it the trainer waits for (staging, offers), the rest overlapping its next step (None:
  all of it, as a push measured end to end is counted). cores_busy (shared
  cores only): how many cores each part keeps busy while it runs (CPU s / wall s; default 1)."""
  decode_tokens_per_s: float
  verify_tasks_per_s: float
  train_tokens_per_s: float
  bulk_bytes_per_s: float
  message_s: float
  push_s: float
  prefill_tokens_per_s: float | None = None
  cores_busy: dict | None = None
  push_wait_s: float | None = None


def part_seconds(w: Workload, layout: Layout, r: Rates) -> dict[str, float]:
  """Seconds of each part per step (see the module docstring)."""
  steps = w.optimizer_steps
  generation = w.completions * w.response_tokens / r.decode_tokens_per_s
  if r.prefill_tokens_per_s:
    generation += w.completions / w.group_size * w.prompt_tokens / r.prefill_tokens_per_s
  follower_share = layout.followers / layout.trainer_processes
  rows_bytes = w.slots_per_step * BYTES_PER_TOKEN_SLOT * follower_share
  messages = 2 * layout.followers + layout.followers / steps
  data = rows_bytes / r.bulk_bytes_per_s + messages * r.message_s
  train = w.slots_per_step / r.train_tokens_per_s
  push = r.push_s
  if r.push_wait_s is not None:   # the pulls run during the next step's data and train
    push = r.push_wait_s + max(0.0, r.push_s - r.push_wait_s - data - train)
  return {
      "generation": generation,
      "scoring": w.completions / r.verify_tasks_per_s,
      "data": steps * data,
      "train": steps * train,
      "push": steps * push,
  }


def overlap_share(w: Workload) -> float:
  """f: the share of a batch's generation that can run while the trainer works on the last one."""
  if w.mode == "sync":
    return 0.0
  return min(1.0, max(0.0, (w.n_async - w.n_batch) / w.n_batch))


def step_time(w: Workload, layout: Layout, r: Rates) -> dict:
  """The step's seconds, each part's seconds and share of the step, the trainer's busy time, the
  overlap share f and the bottleneck (the term of the max that sets the step: 'generation',
  'scoring', 'trainer: <its largest part>' or 'shared cores')."""
  parts = part_seconds(w, layout, r)
  trainer = sum(parts[p] for p in TRAINER_PARTS)
  f = overlap_share(w)
  terms = {"generation": parts["generation"], "scoring": parts["scoring"],
           "trainer": trainer + (1.0 - f) * parts["generation"]}
  if layout.shared_cores:
    busy = r.cores_busy or {}
    terms["shared cores"] = sum(parts[p] * busy.get(p, 1.0) for p in PARTS) / layout.shared_cores
  bound = max(terms, key=terms.get)
  step = terms[bound]
  if bound == "trainer":
    bound = "trainer: " + max(TRAINER_PARTS, key=parts.get)
  return {"step_s": step, "parts_s": parts, "shares": {p: parts[p] / step for p in PARTS},
          "trainer_s": trainer, "overlap_share": f, "terms_s": terms, "bottleneck": bound}


# ---- rates on accelerators, from a model shape and per-chip figures ------------------------------

@dataclasses.dataclass(frozen=True)
class Accelerator:
  """Per-chip figures of a cluster and the efficiencies applied to them.

  peak_tflops, hbm_gbps: the vendor's dense bf16 rate and memory bandwidth. mfu: train step model
  FLOPs / peak. decode_frac: a decode step's bytes (weights + the KV it reads) / (its time x
  hbm_gbps). stage_gbps: the push's cast and layout program, serving bytes written per second on
  one chip. link_gbps: one chip's share of the network between hosts (the push's gather of FSDP
  shards). transfer_gbps: one host's cross-host array transfers (the push to a generator, the
  training rows). verifier_cores: the leader host's cores for the verifier pool."""
  name: str
  peak_tflops: float
  hbm_gbps: float
  memory_gib: float
  chips_per_host: int
  mfu: float
  decode_frac: float
  stage_gbps: float
  link_gbps: float
  transfer_gbps: float
  verifier_cores: int
  platform: str = "cuda"


# Vendor peaks by a substring of jax's device_kind, first match: dense bf16 matmul TFLOP/s and
# memory bandwidth GB/s (the A100 SXM4 80GB's HBM2e before the other A100s').
VENDOR_PEAKS = (("H200", 989.0, 4800.0), ("H100 PCIe", 756.0, 2000.0),
                ("H100", 989.0, 3350.0), ("A100-SXM4-80GB", 312.0, 2039.0), ("A100", 312.0, 1555.0),
                ("TPU v5p", 459.0, 2765.0), ("TPU v5 lite", 197.0, 819.0),
                ("TPU v5e", 197.0, 819.0), ("TPU v4", 275.0, 1228.0))


def vendor_peak(device_kind: str) -> tuple[float | None, float | None]:
  """(bf16 TFLOP/s, GB/s) of a jax device_kind from VENDOR_PEAKS; (None, None) where unknown."""
  for name, tflops, gbps in VENDOR_PEAKS:
    if name.lower() in device_kind.lower():
      return tflops, gbps
  return None, None


def matmul_params(cfg) -> int:
  """Weights a token's matmuls use (the input embedding is gathered; the head, tied or not, is a
  matmul): the count bench/train_mfu.py's MFU uses."""
  return cfg.num_params() - (cfg.vocab_size * cfg.hidden_size if not cfg.tie_word_embeddings
                             else 0)


def train_flops_per_token(cfg, seq_len: float, remat: str = "none") -> float:
  """Forward + backward FLOPs of one token in a causal sequence of seq_len tokens, as
  bench/train_mfu.py counts model FLOPs (6 x matmul weights + 6 x layers x heads x head_dim x
  seq_len), and x 4/3 under remat "full" (the forward runs twice: hardware FLOPs, not model
  FLOPs, set the time)."""
  model = 6.0 * matmul_params(cfg) + 6.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
  return model * (4.0 / 3.0 if remat == "full" else 1.0)


def kv_bytes_per_position(cfg, itemsize: int = 2) -> int:
  """K and V of one position, all layers."""
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def decode_step_bytes(cfg, slots: int, positions: float, tensor: int, itemsize: int = 2) -> float:
  """Bytes one chip of a tensor-parallel engine replica reads and writes in a decode step of
  `slots` sequences, each reading `positions` cache positions: its share of the matmul weights,
  of the KV cache (KV heads split over `tensor`, replicated past their count) and of the fp32
  logits (written and read back), as bench/decode_roofline.py counts them."""
  weights = matmul_params(cfg) * itemsize / tensor
  kv = kv_bytes_per_position(cfg, itemsize) * slots * positions / min(tensor, cfg.num_kv_heads)
  logits = 2 * slots * cfg.vocab_size * 4 / tensor
  return weights + kv + logits


def decode_step_traffic(cfg, params_bytes: int, embed_bytes: int, batch: int, cache_len: float,
                        itemsize: int) -> dict:
  """One engine's decode step from its weights' real bytes, as bench/decode_roofline.py's
  roofline counts it: the bytes it must move (the matmul weights, the gathered embedding rows,
  the KV cache read and written, the fp32 logits written and read back) and its FLOPs (dense
  attention over cache_len positions)."""
  # Every weight a matmul reads; an untied input embedding is only gathered (B rows).
  matmul = params_bytes if cfg.tie_word_embeddings else params_bytes - embed_bytes
  weights = matmul + batch * cfg.hidden_size * itemsize
  kv, kv_write = (kv_bytes_per_position(cfg, itemsize) * batch * n for n in (cache_len, 1))
  logits = 2 * batch * cfg.vocab_size * 4
  flops = 2 * batch * (matmul // itemsize) + \
      4 * batch * cfg.num_layers * cfg.num_heads * cache_len * cfg.head_dim
  return {"weight_bytes": int(weights), "kv_read_bytes": int(kv),
          "other_bytes": int(kv_write + logits),
          "bytes_per_step": int(weights + kv + kv_write + logits), "flops_per_step": int(flops)}


@dataclasses.dataclass(frozen=True)
class ClusterLayout:
  """Trainer chips (FSDP) and generators of `gen_chips` chips each, a `tensor` x data mesh,
  `slots` decode slots per generator, each slot reading `positions_read` cache positions a step
  (dense attention: the whole cache; a paged cache: the live ones). `push`: how the weights
  reach the generators (push_seconds)."""
  trainer_chips: int
  generators: int
  gen_chips: int
  tensor: int
  slots: int
  positions_read: float
  push: str = "leader"

  @property
  def replicas(self) -> int:
    """Engine replicas per generator (its data axis)."""
    return self.gen_chips // self.tensor


def accelerator_rates(cfg, w: Workload, cl: ClusterLayout, acc: Accelerator, *,
                      verify_core_s: float, message_s: float, remat: str = "full") -> Rates:
  """Rates of the parts on `acc` chips laid out as `cl`, for policy shape `cfg` (bf16 serving
  weights and KV). verify_core_s: CPU seconds to score one completion. Assumes every slot busy
  (async keeps n_async - n_batch >> slots in flight) and the trainer's FSDP collectives hidden
  behind its matmuls (the recorded MFU is one chip's)."""
  slots_r = cl.slots / cl.replicas
  step_s = decode_step_bytes(cfg, slots_r, cl.positions_read, cl.tensor) / (
      acc.hbm_gbps * 1e9 * acc.decode_frac)
  decode = cl.generators * cl.replicas * slots_r / step_s
  flop_rate = acc.peak_tflops * 1e12 * acc.mfu
  prefill = cl.generators * cl.gen_chips * flop_rate / (2.0 * matmul_params(cfg))
  seq = w.prompt_tokens + w.response_tokens
  train = cl.trainer_chips * flop_rate / train_flops_per_token(cfg, seq, remat)
  stage, transfer = push_parts(cfg, cl, acc)
  return Rates(decode_tokens_per_s=decode, prefill_tokens_per_s=prefill,
               verify_tasks_per_s=acc.verifier_cores / verify_core_s,
               train_tokens_per_s=train, bulk_bytes_per_s=acc.transfer_gbps * 1e9,
               message_s=message_s, push_s=stage + transfer + 2 * message_s,
               push_wait_s=stage + message_s)


def push_seconds(cfg, cl: ClusterLayout, acc: Accelerator) -> float:
  """One optimizer step's push to every generator: push_parts' stage + transfer."""
  return sum(push_parts(cfg, cl, acc))


def push_parts(cfg, cl: ClusterLayout, acc: Accelerator) -> tuple[float, float]:
  """(stage, transfer) seconds of one optimizer step's push (parallel/weight_transfer.py). The
  trainer casts its params and lays them out as a generator holds them: each chip ends with
  serving bytes / tensor, gathered from FSDP shards mostly on other hosts. Then the bytes cross
  hosts at acc.transfer_gbps a host:
    'leader'  (ours): every generator gets its copy from the hosts of the first gen_chips
              trainer chips, each of its chips its own shard: a copy per data replica, and all
              generators' copies through those hosts;
    'spread'  each generator gets one replica's bytes from its own group of trainer chips (the
              staging program lays a copy on every group), spread over all trainer hosts, and
              copies it across its data axis on its own links."""
  per_chip = cfg.num_params() * 2 / cl.tensor
  remote = 1.0 - min(1.0, acc.chips_per_host / cl.trainer_chips)
  stage = per_chip / (acc.stage_gbps * 1e9) + per_chip * remote / (acc.link_gbps * 1e9)
  if cl.push == "leader":
    hosts = math.ceil(cl.gen_chips / acc.chips_per_host)
    return stage, cl.generators * cl.gen_chips * per_chip / (hosts * acc.transfer_gbps * 1e9)
  if cl.push != "spread":
    raise ValueError(f"push {cl.push!r}: leader or spread")
  trainer_hosts = max(1, cl.trainer_chips // acc.chips_per_host)
  one = cl.tensor * per_chip / (math.ceil(cl.tensor / acc.chips_per_host)
                                * acc.transfer_gbps * 1e9)
  spread = cl.generators * cl.tensor * per_chip / (trainer_hosts * acc.transfer_gbps * 1e9)
  broadcast = per_chip / (acc.link_gbps * 1e9) if cl.replicas > 1 else 0.0
  return stage, max(one, spread) + broadcast
