"""Generation: the JetStream-contract engine, sampling, and the continuous-batching loop."""
from magistral_jax.lazy_exports import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "cpu_options": ("CpuOptions",),
    "engine": ("Engine",),
    "loop": ("GeneratorLoop",),
    "requests": ("GeneratorError", "Request", "Sample"),
    "config": ("EngineConfig", "SamplingConfig"),
    "sampling": ("sample", "token_logprob"),
    "shapes": ("default_buckets",),
    "state": ("DecodeState", "Prefix", "Prefixes", "ResultTokens"),
    "weights": ("NonFiniteError", "ParamsMismatchError"),
})
