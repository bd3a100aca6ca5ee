r"""Will a recipe fit? Bytes per device of its trainer and generators, before launching.

  python launch/plan.py --config=configs/small.py --model=mistral_small_3_24b --devices=v5p-128
  python launch/plan.py --config=configs/medium.py --model=/path/to/checkpoint/config.json \
      --devices=16xH100 --layout=colocated

--model: a shape model/config.py names (lower case), a checkpoint's config.json (or its folder),
comma-separated ModelConfig fields over the config's model section, or 'run' (that section
itself). The run's dtypes, remat and attention knobs apply, as in a run. --layout: 'recipe' (the
config's devices section), 'colocated' or 'split' on the --devices count (run/plan.py relayout).
Prints the largest stage's table (per stage with --all_stages); the logic is
magistral_jax/run/plan.py.
"""
from magistral_jax import cli  # noqa: F401  (before jax: the CPU device count)

import json

from absl import app, flags

from magistral_jax.run import plan as plan_lib

FLAGS = flags.FLAGS
flags.DEFINE_string("devices", "H100", "What to plan on: v5p-128 (TensorCores: 64 chips), "
                    "v5e-16, 8xH100, 16xH200, or a kind alone (H100: as many as the layout asks).")
flags.DEFINE_string("model", "run", "The policy's shape: a named shape (mistral_small_3_24b, "
                    "smollm2_135m, ...), a config.json, 'field=value,...' or 'run'.")
flags.DEFINE_float("device_memory_gb", None, "Usable memory per device in GiB (default: the "
                   "kind's, run/plan.py DEVICE_MEMORY_GIB).")
flags.DEFINE_enum("layout", "recipe", plan_lib.LAYOUTS, "Device layout: the config's, or "
                  "colocated / split over the --devices count.")
flags.DEFINE_bool("all_stages", False, "A table per stage instead of the largest stage's.")
flags.DEFINE_bool("json", False, "Also print one JSON line: GiB per device of each role.")


def main(argv):
  del argv
  devices = plan_lib.parse_devices(FLAGS.devices, FLAGS.device_memory_gb)
  stages = plan_lib.plan_stages(cli.CONFIG.value, FLAGS.model, devices, FLAGS.layout)
  for name, p in stages if FLAGS.all_stages else [plan_lib.largest(stages)]:
    print(plan_lib.format_plan(p, name if len(stages) > 1 else ""), end="\n\n")
  if FLAGS.json:
    name, p = plan_lib.largest(stages)
    print(json.dumps({"stage": name, "fits": p["fits"], "gib_per_device": plan_lib.summary_row(p),
                      "devices_needed": p["devices_needed"]}))


if __name__ == "__main__":
  app.run(main)
