"""PCA of a run's checkpoints: the paper's "length direction" (paper §6).

Stack the T checkpoints' flattened weights as the rows of X (T × W), centre them
(X_c = X - mean over checkpoints) and take the top eigenvectors of X_cᵀX_c (W × W). W is the
parameter count, so that matrix is never formed. Two exact routes:

  gram     eigen-decompose the T × T Gram matrix G = X_c X_cᵀ. If G u = λ u then
           c = X_cᵀ u / √λ is a unit eigenvector of X_cᵀX_c with the same eigenvalue λ.
           Cost O(T²W) time, O(T²) extra memory: the right choice whenever T ≪ W.
  lanczos  scipy's ARPACK Lanczos (eigsh) on a LinearOperator v ↦ X_cᵀ(X_c v), the paper's
           method; each product costs O(TW) and X_c is never materialised.

Both stream over column chunks of X, so the extra memory is one chunk, not a centred copy.
Each component's sign is fixed so that training moved along +c (the last checkpoint projects
higher than the first): "positive α" then means "further in the direction training went".
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

# Columns per chunk are chosen so that one float64 chunk of X_c holds about this many bytes.
_CHUNK_BYTES = 1 << 26


@dataclasses.dataclass(frozen=True)
class PCAResult:
  """Top-k principal directions of the checkpoint trajectory.

  mean: (W,) average of the checkpoints; components: (k, W) unit rows c_i; eigenvalues: (k,)
  λ_i of X_cᵀX_c; projections: (T, k) = X_c c_iᵀ, each checkpoint's coordinate; explained: (k,)
  λ_i / trace(X_cᵀX_c), the fraction of the trajectory's variance along c_i.
  """
  mean: np.ndarray
  components: np.ndarray
  eigenvalues: np.ndarray
  projections: np.ndarray
  explained: np.ndarray

  @property
  def std(self) -> np.ndarray:
    """σ_i = √(λ_i / T): the standard deviation of the checkpoints' coordinates along c_i, the
    natural unit for perturbations along c_i."""
    return np.sqrt(np.maximum(self.eigenvalues, 0.0) / self.projections.shape[0])


# ---- flattening ----------------------------------------------------------------------------------

def flatten_params(params: Any, dtype=np.float32) -> np.ndarray:
  """One parameter tree -> a (W,) vector, leaves in jax.tree order."""
  import jax
  leaves = jax.tree.leaves(params)
  if not leaves:
    raise ValueError("flatten_params: empty parameter tree")
  return np.concatenate([np.asarray(x, dtype).reshape(-1) for x in leaves])


def unflatten_params(vector: np.ndarray, like: Any) -> Any:
  """Inverse of flatten_params: a tree shaped like `like` (each leaf in its dtype)."""
  import jax
  leaves, treedef = jax.tree.flatten(like)
  sizes = [int(np.size(x)) for x in leaves]
  if vector.shape != (sum(sizes),):
    raise ValueError(f"unflatten_params: vector has shape {vector.shape}, the tree needs "
                     f"({sum(sizes)},)")
  out, at = [], 0
  for x, n in zip(leaves, sizes):
    out.append(np.asarray(vector[at:at + n]).reshape(np.shape(x)).astype(np.asarray(x).dtype))
    at += n
  return jax.tree.unflatten(treedef, out)


def stack_checkpoints(param_trees: Sequence[Any], dtype=np.float32) -> np.ndarray:
  """T parameter trees (same structure and shapes) -> X of shape (T, W)."""
  import jax
  if not param_trees:
    raise ValueError("stack_checkpoints: no checkpoints")
  ref = jax.tree.structure(param_trees[0])
  ref_shapes = [np.shape(x) for x in jax.tree.leaves(param_trees[0])]
  for i, p in enumerate(param_trees[1:], 1):
    if jax.tree.structure(p) != ref or [np.shape(x) for x in jax.tree.leaves(p)] != ref_shapes:
      raise ValueError(f"stack_checkpoints: checkpoint {i} has a different parameter tree or "
                       "shapes than checkpoint 0")
  w = sum(int(np.prod(s)) for s in ref_shapes)
  x = np.empty((len(param_trees), w), dtype)
  for i, p in enumerate(param_trees):
    x[i] = flatten_params(p, dtype)
  return x


# ---- PCA -----------------------------------------------------------------------------------------

def _chunks(t: int, w: int, chunk: int | None):
  step = chunk or max(1, _CHUNK_BYTES // (8 * max(1, t)))
  for s in range(0, w, step):
    yield slice(s, min(w, s + step))


def checkpoint_mean(x: np.ndarray, chunk: int | None = None) -> np.ndarray:
  mean = np.empty(x.shape[1], np.float64)
  for sl in _chunks(*x.shape, chunk):
    mean[sl] = x[:, sl].mean(axis=0, dtype=np.float64)
  return mean


def gram_matrix(x: np.ndarray, mean: np.ndarray, chunk: int | None = None) -> np.ndarray:
  """G = X_c X_cᵀ (T × T, float64), accumulated over column chunks."""
  g = np.zeros((x.shape[0], x.shape[0]), np.float64)
  for sl in _chunks(*x.shape, chunk):
    xc = x[:, sl].astype(np.float64) - mean[sl]
    g += xc @ xc.T
  return g


def _components_from_gram(x, mean, u, lam, chunk):
  """c_i = X_cᵀ u_i / √λ_i, streamed over column chunks: (k, W)."""
  comps = np.empty((u.shape[1], x.shape[1]), np.float64)
  scale = 1.0 / np.sqrt(lam)
  for sl in _chunks(*x.shape, chunk):
    xc = x[:, sl].astype(np.float64) - mean[sl]
    comps[:, sl] = (u.T @ xc) * scale[:, None]
  return comps


def _project(x, mean, comps, chunk):
  """X_c cᵢᵀ for every checkpoint and component: (T, k)."""
  p = np.zeros((x.shape[0], comps.shape[0]), np.float64)
  for sl in _chunks(*x.shape, chunk):
    p += (x[:, sl].astype(np.float64) - mean[sl]) @ comps[:, sl].T
  return p


def top_components(x: np.ndarray, k: int = 2, method: str = "gram",
                   chunk: int | None = None, tol: float = 0.0) -> PCAResult:
  """Top-k eigenvectors of X_cᵀX_c for X = stacked checkpoints (T, W); see the module docstring.

  Directions with eigenvalue ~0 (fewer distinct checkpoints than k + 1) are an error: they
  carry no information about the trajectory.
  """
  x = np.asarray(x)
  if x.ndim != 2:
    raise ValueError(f"top_components: X must be (T, W), got shape {x.shape}")
  t, w = x.shape
  if not 1 <= k < t:
    raise ValueError(f"top_components: k={k} needs at least k + 1 = {k + 1} checkpoints "
                     f"(centring removes one dimension), got T={t}")
  mean = checkpoint_mean(x, chunk)
  g = gram_matrix(x, mean, chunk)
  total = float(np.trace(g))
  if method == "gram":
    lam, u = np.linalg.eigh(g)                 # ascending
    lam, u = lam[::-1][:k], u[:, ::-1][:, :k]
    _check_rank(lam, total, t, k)
    comps = _components_from_gram(x, mean, u, lam, chunk)
  elif method == "lanczos":
    from scipy.sparse.linalg import LinearOperator, eigsh
    if k >= w:
      raise ValueError(f"top_components: lanczos needs k < W, got k={k}, W={w}")

    def matvec(v):
      v = np.asarray(v, np.float64).reshape(-1)
      y = np.zeros(t, np.float64)
      for sl in _chunks(t, w, chunk):           # y = X_c v
        y += x[:, sl].astype(np.float64) @ v[sl] - mean[sl] @ v[sl]
      out = np.empty(w, np.float64)
      for sl in _chunks(t, w, chunk):           # X_cᵀ y
        out[sl] = x[:, sl].astype(np.float64).T @ y - mean[sl] * y.sum()
      return out

    op = LinearOperator((w, w), matvec=matvec, rmatvec=matvec, dtype=np.float64)
    v0 = np.random.default_rng(0).standard_normal(w)   # deterministic start vector
    # X_cᵀX_c has rank <= T - 1, so a Krylov basis of T + 1 vectors already holds its range.
    ncv = min(w, max(2 * k + 1, t + 1))
    lam, vecs = eigsh(op, k=k, which="LA", v0=v0, tol=tol, ncv=ncv)
    order = np.argsort(lam)[::-1]
    lam, comps = lam[order], vecs[:, order].T
    _check_rank(lam, total, t, k)
  else:
    raise ValueError(f"top_components: method must be 'gram' or 'lanczos', got {method!r}")
  proj = _project(x, mean, comps, chunk)
  # Orientation: training moves along +c_i (last checkpoint above the first).
  flip = np.where(proj[-1] - proj[0] < 0, -1.0, 1.0)
  comps, proj = comps * flip[:, None], proj * flip[None, :]
  return PCAResult(mean=mean, components=comps, eigenvalues=lam, projections=proj,
                   explained=lam / total if total > 0 else np.zeros_like(lam))


def _check_rank(lam, total, t, k):
  tiny = lam <= max(total, 1e-300) * 1e-12
  if tiny.any():
    raise ValueError(f"top_components: the checkpoints span fewer than k={k} directions "
                     f"(eigenvalues {lam.tolist()}, T={t}); are some checkpoints identical?")


# ---- perturbations -------------------------------------------------------------------------------

def perturbation_grid(pca: PCAResult, multiples1: Sequence[float],
                      multiples2: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(α1, α2) for a grid around w*: α_i = m · σ_i for each multiple m, where σ_i = PCAResult.std
  is the spread of the checkpoints' coordinates along c_i (so m = ±1 moves as far from w* as a
  typical checkpoint lies from the trajectory's mean). `multiples2` defaults to `multiples1`."""
  if pca.components.shape[0] < 2:
    raise ValueError("perturbation_grid: needs the top-2 components")
  m1 = np.asarray(multiples1, np.float64)
  m2 = m1 if multiples2 is None else np.asarray(multiples2, np.float64)
  return m1 * pca.std[0], m2 * pca.std[1]


def perturb(w_star: np.ndarray, components: np.ndarray, alphas: Sequence[float]) -> np.ndarray:
  """w* + Σ_i α_i c_i (flat vectors), in w*'s dtype."""
  alphas = np.asarray(alphas, np.float64)
  if components.shape[0] != alphas.shape[0] or components.shape[1] != w_star.shape[0]:
    raise ValueError(f"perturb: {alphas.shape[0]} alphas and components {components.shape} do "
                     f"not match w* of shape {w_star.shape}")
  return (w_star.astype(np.float64) + alphas @ components).astype(w_star.dtype)
