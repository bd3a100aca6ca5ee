"""A run's generators: one engine and continuous-batching loop per device slice, built from the
`engine` and `sampling` sections, and the prompt prefix they share."""
from __future__ import annotations

from typing import Callable

from magistral_jax.generate.config import EngineConfig, SamplingConfig
from magistral_jax.generate.engine import Engine
from magistral_jax.generate.loop import GeneratorLoop
from magistral_jax.generate.prefix_cache import common_prefix, useful_shared_prefix
from magistral_jax.generate.tool_turns import ToolTurns
from magistral_jax.generate.xla_cpu import PAGED_MIN_POSITIONS_CPU, tune_engine
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.config import GENERATOR_RULES
from magistral_jax.parallel.sharding import make_mesh
from magistral_jax.rewards.tool_run import ToolRunner
from magistral_jax.tool_use.config import ToolConfig


_PREFIX_PROBES = ("0", "x + y = ?", "Why?", "\n# Title", "Le problème", "```python", " x",
                  "  (a)")


def shared_prompt_prefix(tokenizer, system_prompt: str | None) -> list[int]:
  """The token ids every chat prompt of a run starts with: the common prefix of the chat
  template rendered around a few unlike probe problems (the template's head and the system
  prompt; a boundary token that a problem's first characters could merge into is left out
  because the probes disagree on it). GeneratorLoop checks each prompt against it anyway."""
  return common_prefix([tokenizer.apply_chat_template(p, system_prompt) for p in _PREFIX_PROBES])


def shared_prefix_for(engine_cfg: EngineConfig, tokenizer,
                      system_prompt: str | None) -> list[int] | None:
  """What a run's generators get as `shared_prefix` (engine.shared_prefix_cache): the prompts'
  common prefix when it is worth caching (prefix_cache.useful_shared_prefix: at least
  SHARED_PREFIX_MIN_TOKENS tokens, room left under engine.max_prefill_length), else None."""
  if not engine_cfg.shared_prefix_cache:
    return None
  return useful_shared_prefix(shared_prompt_prefix(tokenizer, system_prompt),
                              engine_cfg.max_prefill_length)


def paged_kv(engine_cfg: EngineConfig, sampling: SamplingConfig, platform: str,
             data: int = 1) -> dict:
  """Engine's paged-cache keywords from the `engine` section, for a generator mesh on `platform`
  with a `data` axis of that size (none for a dense cache; "auto" resolved as EngineConfig
  says). There is one pool per data replica (model/kv_cache.py), for the replica's share of the
  slots: kv_pages (each pool's) 0 is a dense cache's worth of that share."""
  positions = engine_cfg.max_prefill_length + sampling.max_new_tokens
  paged = engine_cfg.kv_cache == "paged" or (
      engine_cfg.kv_cache == "auto"
      and (platform != "cpu" or positions >= PAGED_MIN_POSITIONS_CPU))
  if not paged:
    return {}
  ps = engine_cfg.page_size
  slots = -(-engine_cfg.max_concurrent_decodes // data)
  pages = engine_cfg.kv_pages or slots * -(-positions // ps) + 1
  return dict(kv_pages=pages, page_size=ps,
              paged_attention=None if engine_cfg.paged_attention == "auto"
              else engine_cfg.paged_attention)


def engine_for(model_cfg: ModelConfig, devices, sampling: SamplingConfig,
               engine_cfg: EngineConfig = EngineConfig(), *, engines: dict | None = None,
               mesh_shape: dict | None = None, rules=GENERATOR_RULES) -> Engine:
  """An Engine on `devices` (mesh `mesh_shape`, default tensor parallel over them), shaped by
  the `engine` section, decoding up to sampling.max_new_tokens. With `engines` (a run's dict of
  the engines it has built) the one built before with the same mesh, rules, shapes and
  compiled-in sampling (top-p, top-k, greedy) is reused, so the run's evaluation and each
  stage's generators on those devices share its compiled programs: the sampling temperature is
  an input of them, and a loop brings its own (GeneratorLoop's `sampling`). Without a match (or
  without `engines`) a new one is built."""
  mesh = make_mesh(dict(mesh_shape or {"tensor": len(devices)}), devices)
  shape = dict(max_concurrent_decodes=engine_cfg.max_concurrent_decodes,
               max_prefill_length=engine_cfg.max_prefill_length,
               max_decode_length=sampling.max_new_tokens,
               attention_windows=engine_cfg.attention_windows,
               **paged_kv(engine_cfg, sampling, mesh.devices.flat[0].platform,
                          dict(mesh.shape).get("data", 1)))
  key = (tuple(d.id for d in mesh.devices.flat), mesh.axis_names, mesh.devices.shape,
         repr(tuple(rules)), sampling.top_p, sampling.top_k, sampling.greedy,
         tuple(sorted(shape.items())))
  if engines is not None and key in engines:
    return engines[key]
  engine = Engine(model_cfg, mesh, rules, sampling=sampling, **shape)
  if engines is not None:
    engines[key] = engine
  return engine


def make_generators(model_cfg: ModelConfig, params, device_slices, sampling: SamplingConfig,
                    engine_cfg: EngineConfig = EngineConfig(), *, mesh_shape: dict | None = None,
                    version: int = 0, detokenize=None, seed: int = 0, rules=GENERATOR_RULES,
                    shared_prefix=None, engines: dict | None = None,
                    tools: Callable[[], ToolTurns] | None = None) -> list[GeneratorLoop]:
  """One engine + generator loop per device slice (tensor parallel over the slice by default),
  shaped and run as the `engine` section says (generate/config.py EngineConfig), decoding up to
  sampling.max_new_tokens. With engine_cfg.tune each engine times its decode step with both CPU
  dot libraries and keeps the faster, for its drain (compact) steps too (a no-op on
  accelerators). `shared_prefix`: token ids most prompts start with, prefilled once per weights
  version (see shared_prefix_for). `engines`: see engine_for (a run passes its dict, so an engine
  built before on a slice is reused). `tools`: makes each loop's ToolTurns (tool_turns_for), when
  the policy may call the interpreter."""
  loops = []
  for i, devs in enumerate(device_slices):
    engine = engine_for(model_cfg, devs, sampling, engine_cfg, engines=engines,
                        mesh_shape=mesh_shape, rules=rules)
    loop = GeneratorLoop(engine, params, version, sampling=sampling, detokenize=detokenize,
                         seed=seed + i, shared_prefix=shared_prefix, options=engine_cfg,
                         tools=tools() if tools is not None else None)
    if engine_cfg.tune:
      tune_engine(engine, loop.params)
    loops.append(loop)
  return loops


def tool_turns_for(cfg: ToolConfig, tok) -> Callable[[], ToolTurns] | None:
  """What make_generators' `tools` takes for the `tools` section (None unless enabled): each
  loop's ToolTurns runs its calls in this process's sandboxes (rewards/tool_run.ToolRunner, one
  for the process, a sandbox per thread) and tokenizes results with the run's tokenizer, with no
  BOS (a result continues a sequence)."""
  if not cfg.enabled:
    return None
  runner = ToolRunner(cfg)
  return lambda: ToolTurns(cfg, runner, lambda text: tok.encode(text, add_bos=False), tok.decode)
