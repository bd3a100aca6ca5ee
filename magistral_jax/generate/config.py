"""The generation sections of the run config: `sampling` (how tokens are drawn) and `engine`
(the generators' shapes and loop knobs). Plain frozen dataclasses, importing nothing of the
implementation, so that magistral_jax/config.py can assemble them without loading JAX."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How tokens are drawn. top_p, top_k and greedy are compiled into an engine's programs; the
  temperature is an input of them (each decode slot carries the one its sample was started
  with); the rest are host-side.

  temperature: divides the logits (also defines the log-prob reported, see module doc).
  top_p: nucleus mass kept (1.0 = off). top_k: keep the k most likely tokens (0 = off).
  greedy: argmax instead of sampling. max_new_tokens: default cap per completion.
  stop_strings: stop once the detokenized completion contains one (host-side check).
  eos_id: stop token (None = never stop on a token)."""
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  greedy: bool = False
  max_new_tokens: int = 256
  stop_strings: tuple[str, ...] = ()
  eos_id: int | None = None

  def __post_init__(self):
    if not self.temperature > 0:
      raise ValueError(f"SamplingConfig.temperature must be > 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"SamplingConfig.top_k must be >= 0, got {self.top_k}")
    if self.max_new_tokens < 1:
      raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
    object.__setattr__(self, "stop_strings", tuple(self.stop_strings))



@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """The generators' knobs (section `engine`) for generate.engine.Engine and
  generate.loop.GeneratorLoop."""
  max_concurrent_decodes: int = 16   # decode slots per generator
  max_prefill_length: int = 256      # the longest prompt a generator prefills, in tokens
  # On a weights update the KV cache of in-flight sequences is kept, as in the paper (paper §5);
  # True recomputes it under the new weights.
  recompute_kv_on_update: bool = False
  # On CPU, each generator times its decode step with both dot libraries (YNNPACK, Eigen) at
  # start-up and keeps the faster: worth it for a real model on CPU (BENCHMARKS.md, "Generation"),
  # not for the tiny model, whose run it would mostly spend compiling (two compilations per step
  # program). A no-op on accelerators.
  tune: bool = False
  # n > 1 gives each decode step the smallest of n windows over the KV cache that holds its
  # active slots, so it reads that much of the cache instead of all of it (one compiled step per
  # window, halving from the whole cache: S, S/2, ...; Engine.window_for). 1 = dense attention
  # over the whole cache.
  attention_windows: int = 1
  # A worker thread prefills queued prompts while the loop decodes (GeneratorLoop); on CPU the
  # two overlap (more work per second: docs/design_notes.md), on an accelerator they share the
  # device queue. False prefills in the loop thread between steps.
  background_prefill: bool = True
  # With background_prefill, when fewer than this fraction of the slots would decode, the loop
  # fills every free slot with its own prefill before stepping (GeneratorLoop, PrefillWorker.
  # top_up; keeps prefill-bound workloads from decoding near-empty batches). 0 = the worker
  # alone (the loop prefills only when nothing decodes and the worker is idle); 1 = whenever a
  # slot is free and no prefilled sample waits for it.
  loop_prefill_below: float = 0.5
  # The token prefix every prompt of the run starts with (the rendered system prompt and
  # chat-template head; pipeline.generators.shared_prompt_prefix) is prefilled once per weights
  # version and each prompt is prefilled as its own rest only (GeneratorLoop shared_prefix; the
  # same samples up to float rounding). Used when that prefix has at least
  # generate.prefix_cache.SHARED_PREFIX_MIN_TOKENS tokens.
  shared_prefix_cache: bool = True
  # The generator loop dispatches decode step n+1 before it fetches and records step n, so the
  # device decodes while the host transfers tokens, does the bookkeeping and refills slots
  # (GeneratorLoop overlap_host; one step in flight). Same samples; a finished sample's slot is
  # refilled one step later. The synchronous loop leaves the device idle while the host works
  # (BENCHMARKS.md, "Generation"). False: dispatch, fetch, record in turn.
  overlap_host: bool = True
  # "paged": the KV cache is a pool of pages shared by the slots (generate/paging.py), handed out
  # as sequences grow, and a decode step reads only the pages its slots have filled
  # (model/paged_attention.py); a slot that cannot grow when the pool is dry is parked and
  # prefilled again later. "dense": each slot owns cache_length positions from the start, and a
  # step reads all of them (or its attention window). "auto": paged on accelerators, and on CPU
  # from xla_cpu.PAGED_MIN_POSITIONS_CPU positions per sequence (a short cache costs a CPU step
  # less dense; BENCHMARKS.md, "Paged KV cache", has both ends, not the crossover). With a data
  # axis in the generator mesh, one pool per data replica, for its share of the slots.
  kv_cache: str = "auto"
  page_size: int = 16                # positions per page
  # Pages in each data replica's pool, the null page included; 0: as many as a dense cache of
  # the replica's share of max_concurrent_decodes slots holds (the same memory), so raising
  # max_concurrent_decodes puts more sequences in flight in that memory.
  kv_pages: int = 0
  # How a paged decode step attends: "auto" (jax's Pallas paged kernels on GPU and TPU, the ragged
  # gather on CPU) or one of model/paged_attention.IMPLS ("dense" reads every slot's whole table:
  # the reference).
  paged_attention: str = "auto"

  def __post_init__(self):
    if self.max_concurrent_decodes < 1 or self.max_prefill_length < 1:
      raise ValueError(f"engine.max_concurrent_decodes={self.max_concurrent_decodes} and "
                       f"engine.max_prefill_length={self.max_prefill_length} must be >= 1")
    if self.attention_windows < 1:
      raise ValueError(f"engine.attention_windows={self.attention_windows}: the number of "
                       "attention windows must be >= 1")
    if self.kv_cache not in ("auto", "dense", "paged"):
      raise ValueError(f"engine.kv_cache={self.kv_cache!r}: 'auto', 'dense' or 'paged'")
    if self.page_size < 1 or self.kv_pages < 0 or self.kv_pages == 1:
      raise ValueError(f"engine.page_size={self.page_size} must be >= 1 and engine.kv_pages="
                       f"{self.kv_pages} 0 (a dense cache's worth) or >= 2")
    if self.paged_attention not in ("auto", "dense", "ragged", "pallas_gpu", "pallas_tpu"):
      raise ValueError(f"engine.paged_attention={self.paged_attention!r}: 'auto', 'dense', "
                       "'ragged', 'pallas_gpu' or 'pallas_tpu'")
    if not 0.0 <= self.loop_prefill_below <= 1.0:
      raise ValueError(f"engine.loop_prefill_below={self.loop_prefill_below}: a fraction of the "
                       "slots, in [0, 1]")
