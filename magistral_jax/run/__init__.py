"""What launch/*.py runs: each launcher is its flags and one call into a module here (train.py:
an RL run; sft.py: the cold start; eval_checkpoint.py: a checkpoint on evaluation sets; sweep.py:
a grid of runs; convert.py: checkpoint formats; answer.py: `make answer`), plus the pieces those
runs share (recipes.py: a recipe loaded from its path; rehearsal.py: a paper recipe shrunk to a
CPU rehearsal) and the logic of bench/learn.py's experiment (learn.py). The processes of a run on
one machine are parallel/local_cluster.py's."""
