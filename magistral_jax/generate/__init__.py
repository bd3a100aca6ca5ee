"""Generation: the JetStream-contract engine, sampling, and the continuous-batching loop."""
from magistral_jax.generate.cpu_options import CpuOptions
from magistral_jax.generate.engine import Engine
from magistral_jax.generate.loop import GeneratorLoop
from magistral_jax.generate.requests import GeneratorError, Request, Sample
from magistral_jax.generate.config import SamplingConfig
from magistral_jax.generate.sampling import sample, token_logprob
from magistral_jax.generate.shapes import default_buckets
from magistral_jax.generate.state import DecodeState, Prefix, Prefixes, ResultTokens
from magistral_jax.generate.weights import NonFiniteError, ParamsMismatchError
