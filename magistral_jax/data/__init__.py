"""Data: TFDS datasets (array_record, no TensorFlow), grain loaders and the paper's format filter.

  records        the canonical math / code / SFT records and adapters from public layouts
  jsonl          reading damaged JSONL: bad rows skipped, counted per reason, logged by row
  tfds_builders  TFDS builders from local JSONL; build_dataset / build_shipped / load_source
  loader         grain: ProblemLoader (RL problem dicts), SftLoader (tokenised, packed);
                 shuffle, repeat, data-parallel shards, JSON state for the checkpoint
  format_filter  proofs, multi-part, multiple choice -> open answer, verifiable answers
  synthetic      seeded multi-step arithmetic problems and traces (the tiny default task)
  prompts        a run's held-out set and RL prompt stream (resumable)
  splits         held-out versus trained-on: problem keys (id, normalised text), overlap errors
  gsm8k_traces   GSM8K's worked solutions as Magistral-format SFT traces (configs/smollm2.py)
  sources/       the shipped public sets (see sources/SOURCES.md)
The filters that run a model or the verifiers (difficulty, code tests, translation) and the run
over JSONL into a filtered dataset are magistral_jax/curate/: data/ imports nothing above it.
"""
