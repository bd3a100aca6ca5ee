"""A generator process of a many-host run (README.md, "Many hosts"): one generator on this
process's devices, driven by the trainer leader (pipeline.generator_service.serve_generator),
scoring the evaluations it is asked for with its own verifier pool (and, with
verifier.placement="generators", every completion it generates). Its weights only ever come from
the trainer, by device-to-device transfer. A relaunched generator process (same process id)
rejoins the running run (pipeline/remote.py)."""
from __future__ import annotations

import logging

from magistral_jax.config import RunConfig
from magistral_jax.eval.in_run import eval_loop_factory, run_eval
from magistral_jax.parallel import multihost
from magistral_jax.parallel.multihost import Mailbox, ProcessLayout
from magistral_jax.parallel.sharding import make_mesh
from magistral_jax.pipeline.generator_service import serve_generator
from magistral_jax.pipeline.generators import make_generators, tool_turns_for
from magistral_jax.pipeline.remote import weight_transfer
from magistral_jax.run.stages import Stage, training_sampling
from magistral_jax.verify.pool import VerifierPool

log = logging.getLogger(__name__)


def run_generator_process(run: RunConfig, stages: list[Stage], layout: ProcessLayout, tok,
                          model_cfg, system_prompt, shared_prefix) -> None:
  rules = run.sharding.generator_rules
  devices = layout.generator_devices()[layout.generator_index]
  mesh = make_mesh(run.devices.generator_mesh, devices)
  transfer = weight_transfer(model_cfg, mesh, rules, layout.trainer_devices())
  engines = {}   # generators.engine_for: the evaluation and every stage share an engine
  eval_loop = eval_loop_factory(run, model_cfg, devices, tok, shared_prefix, engines)
  pool = VerifierPool.from_config(run.verifier, run.reward)

  def make_loop(si, params, version):
    srun = stages[si].run
    [loop] = make_generators(model_cfg, params, [devices], training_sampling(srun, tok.eos_id),
                             srun.engine, mesh_shape=srun.devices.generator_mesh,
                             version=version, seed=run.seed + si, rules=rules,
                             shared_prefix=shared_prefix, engines=engines,
                             tools=tool_turns_for(srun.tools, tok))
    return loop

  def make_eval(tag, params, problems):
    return run_eval(eval_loop, pool, tok, problems, run, system_prompt, params, tag)

  score = None   # the leader scores, unless this host's pool does (verifier.placement)
  if run.verifier.placement == "generators":
    def score(sample):
      return pool.submit(sample.metadata, sample.graded(tok.decode), sample.num_policy_tokens,
                         int(sample.request_id))
  inc = multihost.incarnation()
  log.info("process %d: %s on %d device(s)%s", layout.process_id, layout.role, len(devices),
           f", relaunched (incarnation {inc})" if inc > 1 else "")
  try:
    serve_generator(layout, Mailbox("run"), incarnation=inc, make_loop=make_loop,
                    make_eval=make_eval, transfer=transfer, score=score)
    multihost.leave()
  finally:
    pool.close()
