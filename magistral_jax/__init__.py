"""magistral_jax: a JAX reproduction of the Magistral RL pipeline (arXiv 2506.10910)."""
