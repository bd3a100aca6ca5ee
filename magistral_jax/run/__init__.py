"""What launch/*.py runs: each launcher is its flags and one call into a module here (train.py:
an RL run; sft.py: the cold start; sweep.py: a grid of runs; convert.py: checkpoint formats;
answer.py: `make answer`), plus the pieces those runs share (recipes.py: a recipe loaded from its
path; rehearsal.py: a paper recipe shrunk to a CPU rehearsal). launch/eval.py's evaluation is
eval/checkpoint.py's. The processes of a run on one machine are parallel/local_cluster.py's."""
