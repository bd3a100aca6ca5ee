r"""Cold-start SFT: `python launch/sft.py --config=configs/sft_small.py --workdir=runs/sft_small`.

Next-token loss on the response tokens of (prompt, reasoning trace) pairs, the prompt built with
the tokenizer's chat template and the run's system prompt (paper §4: Magistral Small is fine-tuned
on Medium's traces before RL). The traces come from

  * data.source = "synthetic": worked traces of the synthetic arithmetic task (configs/tiny.py);
    an endless stream, so sft.num_steps must be set;
  * otherwise data.source names built SFT datasets (comma-separated) under data.data_dir (build
    them with magistral_jax.data.tfds_builders.build_dataset("sft", ...)); read packed and
    shuffled by SftLoader for sft.epochs epochs, or sft.num_steps steps if that is > 0.
    "gsm8k_traces" (configs/smollm2.py:sft) is built on first use, checked against the held-out
    set.

A pair longer than sft.row_len is cut to its row (train/sft.py sft_pairs_to_tokens). Writes the
final params as an orbax checkpoint at WORKDIR/params (+ the model's WORKDIR/config.json; the run
configuration is WORKDIR/sft_config.json), which `init.source="orbax", init.path=WORKDIR/params`
(configs/small.py) loads for RL; metrics.jsonl, tb/, sft_summary.json; resumable checkpoints in
WORKDIR/checkpoints (a rerun continues from the latest one). The run is magistral_jax/run/sft.py.
"""
from magistral_jax import cli  # noqa: F401  (the shared flags; before jax: the CPU device count)

from absl import app  # noqa: E402


def main(argv):
  del argv
  config = cli.start_run()
  from magistral_jax.run.sft import run_sft
  run_sft(config, cli.workdir())


if __name__ == "__main__":
  app.run(main)
