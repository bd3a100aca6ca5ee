"""The async RL loop: generators on their own slices, verifier pool, trainer, weight pushes."""
from magistral_jax.pipeline.rl_pipeline import PipelineConfig, PipelineError, RLPipeline
