"""The tunix side of bench/vs_tunix.py: google-tunix's GRPOLearner.train on the shared workload,
under the peer's own interpreter (nothing of magistral_jax); bench/peers/README.md has the rest.

  python tunix_side.py --spec=SPEC.json [--score=FILE]

Last line: one JSON object with the same per-iteration figures as ours_side.py.
"""
import os
import sys
import time

from peer_common import (jitter, side_main, side_summary, time_calls, versions,
                         weights_checksum)


def boxed(text: str) -> str | None:
  """The content of the last \\boxed{...} in `text` (balanced braces), or None."""
  start = text.rfind("\\boxed{")
  if start < 0:
    return None
  depth, i = 1, start + len("\\boxed{")
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i:j]
  return None


def reward_fn(prompts, completions, answer, **_):
  """The rule our side's verifier is configured to (paper §2's format gate: the completion starts
  with <think>, has one <think> and one </think>, and a \\boxed{} answer after </think>; then
  0.1 for the format + 0.9 if the boxed answer equals the reference, here as strings), plus the
  shared tie-breaker."""
  del prompts
  out = []
  for completion, ref in zip(completions, answer):
    completion, r = str(completion), 0.0
    if (completion.startswith("<think>") and completion.count("<think>") == 1
        and completion.count("</think>") == 1):
      got = boxed(completion.split("</think>", 1)[1])
      if got is not None:
        r = 0.1 + 0.9 * (got.strip() == str(ref).strip())
    out.append(r + jitter(completion))
  return out


class SharedTokenizer:
  """The shared tokenizer.json, with the interface tunix's TokenizerAdapter accepts."""

  def __init__(self, path: str, bos: int | None, eos: int, pad: int):
    from tokenizers import Tokenizer
    self._tok = Tokenizer.from_file(path)
    self._bos, self._eos, self._pad = bos, eos, pad

  def encode(self, text: str, **_) -> list[int]:
    return self._tok.encode(str(text), add_special_tokens=False).ids   # np.str_ from the learner

  def decode(self, ids, **_) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def bos_id(self):
    return self._bos

  def eos_id(self):
    return self._eos

  def pad_id(self):
    return self._pad


def run(spec: dict) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  from tunix.models.llama3 import model as llama_lib
  from tunix.models.llama3 import params as llama_params
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout
  from tunix.utils import mesh as tunix_mesh

  t_setup = time.perf_counter()
  m = spec["model"]
  dtype = jnp.dtype(spec["dtype"])
  B, G = spec["prompts_per_iteration"], spec["group_size"]
  N, P = spec["max_new_tokens"], spec["max_prompt_length"]
  total = spec["warmup"] + spec["iterations"]
  mesh = tunix_mesh.create_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1])
  config = llama_lib.ModelConfig(
      num_layers=m["num_layers"], vocab_size=m["vocab_size"], embed_dim=m["hidden_size"],
      hidden_dim=m["intermediate_size"], num_heads=m["num_heads"], head_dim=m["head_dim"],
      num_kv_heads=m["num_kv_heads"], rope_theta=int(m["rope_theta"]),
      norm_eps=m["rms_norm_eps"], weight_tying=m["tie_word_embeddings"])
  with mesh:
    model = llama_params.create_model_from_safe_tensors(spec["weights_dir"], config, mesh,
                                                        dtype=dtype)
  checksum = weights_checksum(jax.tree.leaves(nnx.state(model, nnx.Param)))
  # pad: an id the model cannot produce (tunix masks every token equal to it, generated ones too).
  tokenizer = SharedTokenizer(spec["tokenizer_json"], spec["bos_id"], spec["eos_id"],
                              pad=spec["never_id"])

  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(spec["learning_rate"], b1=0.9, b2=0.95, eps=1e-8,
                               weight_decay=0.0))
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                    rl_cluster_lib.Role.ROLLOUT: mesh},
      rollout_engine="vanilla", offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=tx, eval_every_n_steps=10**9, max_steps=total,
          mini_batch_size=B, train_micro_batch_size=spec.get("micro_prompts", B),
          rollout_micro_batch_size=B,
          compute_logps_micro_batch_size=spec.get("micro_prompts", B), pbar_description=None),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=N, max_prompt_length=P, kv_cache_size=P + N,
          temperature=spec["temperature"], top_p=1.0, top_k=None,
          eos_tokens=[spec["never_id"]], seed=int(spec["seed"])))
  cluster = rl_cluster_lib.RLCluster(actor=model, reference=None, tokenizer=tokenizer,
                                     cluster_config=cluster_config)
  algo = grpo_learner.GRPOConfig(num_generations=G, num_iterations=1, beta=0.0, epsilon=0.2,
                                 loss_agg_mode="token-mean")
  try:
    algo.epsilon_high = 0.28
    eps_high = 0.28
  except AttributeError:   # a slots dataclass without the field: the loss uses epsilon for both
    eps_high = None
  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[reward_fn])

  # The sampler must tokenize the spec's prompt text to the spec's ids.
  sampler = cluster.rollout._sampler   # pylint: disable=protected-access
  for p in spec["prompts"]:
    got = [int(i) for i in sampler.tokenize(p["text"])]
    if got != p["ids"]:
      raise RuntimeError(f"tunix tokenizes prompt {p['id']} to {len(got)} ids, the spec has "
                         f"{len(p['ids'])}: {got[:12]} vs {p['ids'][:12]}")
  setup_s = time.perf_counter() - t_setup

  ev = {"generate": [], "tokens": [], "completions": [], "rewards": [], "update": [],
        "sync": [], "iter_end": []}

  def count(out):
    ev["tokens"].append(int(sum(len(t) for t in out.tokens)))
    ev["completions"].append(len(out.tokens))

  def wait_for_weights(_):
    jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
    ev["iter_end"].append(time.perf_counter())

  time_calls(cluster, "generate", ev["generate"], count)
  time_calls(learner, "_compute_rewards", ev["rewards"])
  time_calls(cluster, "update_actor", ev["update"], wait_for_weights)
  time_calls(cluster, "sync_weights", ev["sync"])

  # Arrays, as tunix's data pipelines give them (the learner repeats each leaf G times along
  # axis 0; a Python list would be a pytree of single strings).
  dataset = [{"prompts": np.array([p["text"] for p in spec["prompts"][i * B:(i + 1) * B]]),
              "answer": np.array([p["answer"] for p in spec["prompts"][i * B:(i + 1) * B]])}
             for i in range(total)]
  t0 = time.perf_counter()
  with mesh:
    learner.train(dataset)
  if len(ev["iter_end"]) != total:
    raise RuntimeError(f"tunix ran {len(ev['iter_end'])} of {total} iterations")

  record = lambda i, s, e, within: {
      "iteration_s": e - s, "rollout_s": within("generate"), "scoring_s": within("rewards"),
      "train_step_s": within("update"), "weight_sync_s": within("sync"),
      "generated_tokens": ev["tokens"][i], "completions": ev["completions"][i]}
  return side_summary(
      spec, t0, ev, record, setup_s=setup_s, weights_checksum=checksum,
      optimizer_steps=int(cluster.actor_trainer.train_steps), epsilon_high=eps_high,
      versions=versions(("google-tunix", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
                         "safetensors")),
      safetensors_from=os.path.dirname(sys.modules["safetensors"].__file__)
      if "safetensors" in sys.modules else None)


if __name__ == "__main__":   # --score imports no tunix: our interpreter runs it too
  side_main(__doc__, run, lambda spec: reward_fn(None, spec["completions"], spec["answers"]))
