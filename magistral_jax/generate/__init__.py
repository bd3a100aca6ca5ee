"""Generation: the JetStream-contract engine, sampling, and the continuous-batching loop."""
from magistral_jax.generate.engine import (DecodeState, Engine, NonFiniteError, ParamsMismatchError,
                                           Prefix, Prefixes, ResultTokens, default_buckets)
from magistral_jax.generate.loop import Completion, GeneratorError, GeneratorLoop, Request
from magistral_jax.generate.sampling import SamplingConfig, sample, token_logprob
