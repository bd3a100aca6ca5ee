"""Assembling a run: device slices, generator engines, and the SFT warm start of the tiny task."""
from __future__ import annotations

import logging
import time
from typing import Iterable, Sequence

import jax

from magistral_jax.generate.engine import Engine
from magistral_jax.generate.loop import GeneratorLoop
from magistral_jax.generate.prefix_cache import common_prefix, useful_shared_prefix
from magistral_jax.generate.sampling import SamplingConfig
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import GENERATOR_RULES, make_mesh

log = logging.getLogger(__name__)


COLOCATED_HINT = ("for fewer devices use the colocated layout, where the trainer and one "
                  "generator share the trainer's devices and take turns: --config=<recipe>:"
                  "colocated (configs/tiny.py, configs/smollm2.py) or "
                  "--config.devices.colocated=True --config.devices.trainer=<devices>")


def check_device_layout(trainer_devices: int, generator_devices: Sequence[int],
                        num_devices: int, colocated: bool = False) -> None:
  """Raises a clear error unless the trainer and every generator get >= 1 of `num_devices`
  (colocated: the trainer's devices alone, which the generator shares)."""
  generator_devices = tuple(generator_devices)
  if colocated:
    if not 1 <= trainer_devices <= num_devices:
      raise ValueError(f"devices: colocated on trainer={trainer_devices} devices, but this "
                       f"machine has {num_devices} ({jax.default_backend()})")
    return
  if trainer_devices < 1 or not generator_devices or any(n < 1 for n in generator_devices):
    raise ValueError(f"device layout needs >= 1 device for the trainer and each generator, got "
                     f"trainer={trainer_devices}, generators={generator_devices}")
  need = trainer_devices + sum(generator_devices)
  if need > num_devices:
    raise ValueError(f"devices: trainer={trainer_devices} + generators={generator_devices} = "
                     f"{need} devices, but this machine has {num_devices} "
                     f"({jax.default_backend()}); {COLOCATED_HINT}")


def split_devices(trainer_devices: int, generator_devices: Sequence[int],
                  devices: Sequence[jax.Device] | None = None, colocated: bool = False):
  """Disjoint device slices: the first `trainer_devices` for the trainer, then one slice per
  generator. E.g. on 8 devices: split_devices(4, [2, 2]) -> 4 | 2 | 2. Colocated: one generator
  on the trainer's own devices, split_devices(1, ..., colocated=True) -> [d0], [[d0]]."""
  devices = list(jax.devices() if devices is None else devices)
  check_device_layout(trainer_devices, generator_devices, len(devices), colocated)
  trainer = devices[:trainer_devices]
  if colocated:
    return trainer, [trainer]
  gens, i = [], trainer_devices
  for n in generator_devices:
    gens.append(devices[i:i + n])
    i += n
  return trainer, gens


def is_colocated(config) -> bool:
  """Whether a run config shares its devices between trainer and generator (devices.colocated;
  absent in configs written before the mode existed)."""
  return bool(config.devices.get("colocated", False))


def run_devices(config):
  """split_devices for a run config's `devices` section: (trainer devices, generator slices).
  One process's layouts only (launch/train.py takes many: parallel.multihost)."""
  if jax.process_count() > 1:
    raise ValueError(f"this launcher runs in one process, but this is a run of "
                     f"{jax.process_count()}; across processes, launch/train.py with "
                     "devices.trainer_processes (README.md \"Many hosts\")")
  return split_devices(config.devices.trainer, list(config.devices.generators),
                       colocated=is_colocated(config))


def system_prompt_for(name: str) -> str | None:
  """The run config's `system_prompt` name -> its text: "magistral" (paper §2), "tiny" (the
  one-line prompt of the synthetic task) or "none"."""
  from magistral_jax.data.synthetic import TINY_SYSTEM_PROMPT
  from magistral_jax.model.tokenizer import MAGISTRAL_SYSTEM_PROMPT
  table = {"magistral": MAGISTRAL_SYSTEM_PROMPT, "tiny": TINY_SYSTEM_PROMPT, "none": None}
  if name not in table:
    raise ValueError(f"system_prompt must be one of {sorted(table)}, got {name!r}")
  return table[name]


def build_tokenizer_and_model(config, load_weights: bool = True):
  """(tokenizer, ModelConfig, initial params or None) of a run config's policy.

  init.source: random (config.model), gguf, hf or orbax (architecture from the checkpoint; the
  run's dtype/remat/logits_chunk/logits_vocab_pieces/attention_* kept). With load_weights=False
  only metadata is read (params is None): enough to build engines or abstract params, e.g. for
  analysing a run's checkpoints.
  """
  import os
  from magistral_jax.model.gguf_checkpoint import gguf_config, load_gguf
  from magistral_jax.model.gguf_file import default_gguf_path, read_gguf
  from magistral_jax.model.hf_checkpoint import load_hf_safetensors
  from magistral_jax.model.orbax_params import read_orbax_config, restore_params_orbax
  from magistral_jax.model.char_tokenizer import char_tokenizer
  from magistral_jax.model.tokenizer import HFTokenizer, load_tokenizer
  src, path = config.init.source, config.init.path
  model_cfg = ModelConfig.from_config_dict(config.model)
  keep = dict(param_dtype=model_cfg.param_dtype, dtype=model_cfg.dtype, remat=model_cfg.remat,
              logits_chunk=model_cfg.logits_chunk,
              logits_vocab_pieces=model_cfg.logits_vocab_pieces,
              attention_impl=model_cfg.attention_impl,
              attention_block_q=model_cfg.attention_block_q,
              attention_block_k=model_cfg.attention_block_k)
  params, tok = None, None
  if src == "gguf":   # architecture and vocabulary come from the file's metadata
    if load_weights:
      cfg_g, params, tok = load_gguf(path or None)
    else:
      gpath = path or default_gguf_path()
      gf = read_gguf(gpath)
      cfg_g, tok = gguf_config(gf, gpath), HFTokenizer.from_gguf_metadata(gf.metadata, gpath)
    model_cfg = cfg_g.replace(**keep)
  elif src == "hf":
    if load_weights:
      cfg_h, params = load_hf_safetensors(path)
    else:
      cfg_h = ModelConfig.from_hf_config(path)
    model_cfg = cfg_h.replace(**keep)
  elif src == "orbax":
    model_cfg = read_orbax_config(path).replace(**keep)
    if load_weights:
      sub = os.path.join(path, "params")
      params = restore_params_orbax(sub if os.path.isdir(sub) else path)
  elif src != "random":
    raise ValueError(f"init.source must be random|gguf|hf|orbax, got {src!r}")
  if tok is None:
    tok = char_tokenizer() if config.tokenizer == "char" else load_tokenizer(config.tokenizer)
  if model_cfg.vocab_size < tok.vocab_size:
    raise ValueError(f"model vocab_size={model_cfg.vocab_size} < tokenizer vocab "
                     f"{tok.vocab_size} ({config.tokenizer})")
  model_cfg = model_cfg.replace(eos_token_id=tok.eos_id, bos_token_id=tok.bos_id)
  return tok, model_cfg, params


def sft_optimizer_config(config):
  """The cold-start SFT optimizer of a run config (`sft` section): AdamW at sft.learning_rate,
  sft.warmup_steps of linear warmup, then constant or cosine over the rest of sft.num_steps."""
  from magistral_jax.train.optimizer import OptimizerConfig
  sft = config.sft
  if sft.get("schedule", "constant") == "cosine" and int(sft.num_steps) <= 0:
    raise ValueError("sft.schedule='cosine' needs sft.num_steps > 0 (the decay length); "
                     "epoch-based SFT (num_steps=0) takes schedule='constant'")
  decay = max(1, int(sft.num_steps) - int(sft.get("warmup_steps", 0)))
  return OptimizerConfig(learning_rate=sft.learning_rate,
                         warmup_steps=int(sft.get("warmup_steps", 0)),
                         schedule=sft.get("schedule", "constant"), decay_steps=decay,
                         final_lr_frac=sft.get("final_lr_frac", 0.1))


_PREFIX_PROBES = ("0", "x + y = ?", "Why?", "\n# Title", "Le problème", "```python", " x",
                  "  (a)")


def shared_prompt_prefix(tokenizer, system_prompt: str | None) -> list[int]:
  """The token ids every chat prompt of a run starts with: the common prefix of the chat
  template rendered around a few unlike probe problems (the template's head and the system
  prompt; a boundary token that a problem's first characters could merge into is left out
  because the probes disagree on it). GeneratorLoop checks each prompt against it anyway."""
  return common_prefix([tokenizer.apply_chat_template(p, system_prompt) for p in _PREFIX_PROBES])


def shared_prefix_for(engine_cfg, tokenizer, system_prompt: str | None) -> list[int] | None:
  """What a run's generators get as `shared_prefix` (config engine.shared_prefix_cache): the
  prompts' common prefix when it is worth caching (generate.loop.useful_shared_prefix: at least
  SHARED_PREFIX_MIN_TOKENS tokens, room left under engine.max_prefill_length), else None."""
  if not engine_cfg.get("shared_prefix_cache", False):
    return None
  return useful_shared_prefix(shared_prompt_prefix(tokenizer, system_prompt),
                              int(engine_cfg.max_prefill_length))


def engine_for(model_cfg: ModelConfig, devices, sampling: SamplingConfig, *,
               engines: dict | None = None, mesh_shape: dict | None = None,
               rules=GENERATOR_RULES, **shape) -> Engine:
  """An Engine on `devices` (mesh `mesh_shape`, default tensor parallel over them) with Engine's
  shape keywords `shape`. With `engines` (a run's dict of the engines it has built) the one built
  before with the same mesh, rules, shapes and compiled-in sampling (top-p, top-k, greedy) is
  reused, so the run's evaluation and each stage's generators on those devices share its
  compiled programs: the sampling temperature is an input of them, and a loop brings its own
  (GeneratorLoop's `sampling`). Without a match (or without `engines`) a new one is built."""
  mesh = make_mesh(dict(mesh_shape or {"tensor": len(devices)}), devices)
  key = (tuple(d.id for d in mesh.devices.flat), mesh.axis_names, mesh.devices.shape,
         repr(tuple(rules)), sampling.top_p, sampling.top_k, sampling.greedy,
         tuple(sorted(shape.items())))
  if engines is not None and key in engines:
    return engines[key]
  engine = Engine(model_cfg, mesh, rules, sampling=sampling, **shape)
  if engines is not None:
    engines[key] = engine
  return engine


def make_generators(model_cfg: ModelConfig, params, device_slices, sampling: SamplingConfig, *,
                    mesh_shape: dict | None = None, max_concurrent_decodes: int,
                    max_prefill_length: int, max_decode_length: int, version: int = 0,
                    detokenize=None, recompute_kv_on_update: bool = False, seed: int = 0,
                    rules=GENERATOR_RULES, tune: bool = False,
                    attention_windows: int = 1,
                    background_prefill: bool = False,
                    loop_prefill_below: float = 0.5,
                    shared_prefix=None, overlap_host: bool = True,
                    engines: dict | None = None) -> list[GeneratorLoop]:
  """One engine + generator loop per device slice (tensor parallel over the slice by default).
  With `tune` each engine times its decode step with both CPU dot libraries and keeps the faster,
  for its drain (compact) steps too (Engine.tune; CPU only, a no-op on accelerators). It costs
  two compilations of each step at start-up, so it is off by default; without it the untuned
  slot-count rule of engine.generate_compiler_options applies. `attention_windows`: see
  Engine (the number of windows over the KV cache; 1 = dense). `background_prefill`,
  `loop_prefill_below`: see GeneratorLoop (a worker thread prefills queued prompts while the loop
  decodes; the loop prefills itself when too few slots would decode). `shared_prefix`: token ids
  most prompts start with, prefilled once per weights version (GeneratorLoop; see
  shared_prefix_for). `overlap_host`: GeneratorLoop's one decode step in flight. `engines`: see
  engine_for (a run passes its dict, so an engine built before on a slice is reused)."""
  loops = []
  for i, devs in enumerate(device_slices):
    engine = engine_for(model_cfg, devs, sampling, engines=engines, mesh_shape=mesh_shape,
                        rules=rules, max_concurrent_decodes=max_concurrent_decodes,
                        max_prefill_length=max_prefill_length,
                        max_decode_length=max_decode_length, attention_windows=attention_windows)
    loop = GeneratorLoop(engine, params, version, sampling=sampling, detokenize=detokenize,
                         recompute_kv_on_update=recompute_kv_on_update, seed=seed + i,
                         background_prefill=background_prefill,
                         loop_prefill_below=loop_prefill_below, shared_prefix=shared_prefix,
                         overlap_host=overlap_host)
    if tune:
      engine.tune(loop.params)
    loops.append(loop)
  return loops


def sft_warm_start(state, sft_step, tokenizer, examples: Iterable[tuple[str, str]], *,
                   num_steps: int, batch_size: int, row_len: int, rows_per_micro: int,
                   system_prompt: str | None, mesh=None, log_every: int = 10, writer=None):
  """Cold-start SFT: `num_steps` steps of next-token loss on (problem, completion) pairs, the
  prompt built with the tokenizer's chat template and masked out of the loss."""
  from magistral_jax.train.sft import sft_collate
  from magistral_jax.parallel.multihost import to_host
  from magistral_jax.train.step import shard_batch
  it = iter(examples)
  t0 = time.time()
  metrics = {}
  for step in range(num_steps):
    pairs = []
    for _ in range(batch_size):
      problem, completion = next(it)
      prompt = tokenizer.apply_chat_template(problem, system_prompt)
      # A pair longer than the row is cut to it: the model learns its start and never its end
      # (synthetic.ramble_trace relies on it). A prompt alone over the row is an error.
      room = row_len - len(prompt)
      if room < 1:
        raise ValueError(f"sft: a prompt of {len(prompt)} tokens leaves no room in a row of "
                         f"{row_len} tokens; raise sft.row_len")
      pairs.append((prompt, (tokenizer.encode(completion) + [tokenizer.eos_id])[:room]))
    arrays, _ = sft_collate(pairs, row_len, rows_per_micro)
    state, metrics = sft_step(state, shard_batch(arrays, mesh))
    if (step + 1) % log_every == 0 or step + 1 == num_steps:
      metrics = {k: float(v) for k, v in to_host(metrics).items()}
      rate = (step + 1) / (time.time() - t0)
      log.info("sft step %d/%d | %.2f steps/s | nll/token %.4f", step + 1, num_steps, rate,
               metrics.get("nll_per_token", float("nan")))
      if writer is not None:
        writer.write(step + 1, {f"sft/{k}": v for k, v in metrics.items()})
  return state, metrics
