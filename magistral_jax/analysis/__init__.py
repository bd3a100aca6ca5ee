"""Analysis of training runs, used by the notebooks (notebooks/), and a model of a step at scale:

  run.py               a workdir's config, every checkpoint's params (no optimizer state), metrics
  pca.py               checkpoint PCA through the T×T Gram matrix or Lanczos, perturbation grid
  length_dimension.py  the paper's "length dimension": score the grid, fit reward vs log(length)
  report.py            metric series and panels for the run report
  plots.py             matplotlib figures (imported only by the notebooks)
  scale_model.py       one RL step's time from its parts' rates (bench/scale_model.py)
  exposure.py          which held-out problems a run recorded before issue #63 had trained on
"""
