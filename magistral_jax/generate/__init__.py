"""Generation: the JetStream-contract engine, sampling, and the continuous-batching loop."""
