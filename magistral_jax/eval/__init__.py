"""Evaluation, in one room: sampling k answers per held-out problem and grading them
(evaluate.py), pass@k and maj@k (pass_at_k.py), two evaluations of the same problems compared
with a paired bootstrap (paired.py), the held-out evaluations inside an RL run (in_run.py), a
checkpoint on evaluation sets as launch/eval.py asks (checkpoint.py). Its config section is
magistral_jax/config.py's EvalConfig: this room runs whole run configs, so it sits above them."""
