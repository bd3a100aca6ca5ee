"""analysis/: checkpoints of a run read back (params only), the checkpoint PCA recovers planted
directions, the perturbation grid is scored through the engine + verifier pool without
recompiling, reward vs log(length) fit, run-report metric handling, clear errors."""
import json

import jax
import numpy as np
import pytest

from magistral_jax.analysis import length_dimension as ld
from magistral_jax.analysis import pca as P
from magistral_jax.analysis import report
from magistral_jax.analysis import workdir as R

STEPS = (0, 1, 2, 3, 4)
DRIFT, WOBBLE, NOISE = 4.0, 1.5, 1e-3   # norms (whole weight vector) of the planted motions


def _tiny_config(arg="batches=4,sft_steps=0"):
  from configs import tiny
  return tiny.get_config(arg)


def _unit(v):
  return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
  """A workdir shaped like launch/train.py's for the tiny model: config.json and five
  checkpoints written by the trainer's RunCheckpointer (sharded TrainState on a 4-device fsdp
  mesh), whose params move along d1 (steadily) and d2 (back and forth) plus small noise."""
  from magistral_jax import config as config_lib
  from magistral_jax.parallel.config import TRAINER_RULES
  from magistral_jax.parallel.sharding import make_mesh
  from magistral_jax.train.checkpointing import RunCheckpointer
  from magistral_jax.train.optimizer import make_optimizer
  from magistral_jax.train.step import init_state, state_shardings
  workdir = tmp_path_factory.mktemp("planted_run")
  config = _tiny_config()
  (workdir / "config.json").write_text(config.to_json(indent=1))
  model_cfg, _ = R.model_and_tokenizer(config)
  tx = make_optimizer(config_lib.validate(config).optimizer)
  mesh = make_mesh({"fsdp": -1}, jax.devices()[:4])
  state = init_state(model_cfg, tx, jax.random.PRNGKey(0), mesh, TRAINER_RULES)
  p_sh = state_shardings(model_cfg, tx, mesh, TRAINER_RULES).params
  p0 = jax.tree.map(np.asarray, state.params)
  w0 = P.flatten_params(p0)
  rng = np.random.default_rng(1)
  d1 = _unit(rng.standard_normal(w0.size))
  d2 = rng.standard_normal(w0.size)
  d2 = _unit(d2 - (d2 @ d1) * d1)
  ck = RunCheckpointer(str(workdir / "checkpoints"), keep=50)
  flats = []
  for t in STEPS:
    w = (w0 + DRIFT * t * d1 + WOBBLE * (-1) ** t * d2
         + NOISE * _unit(rng.standard_normal(w0.size))).astype(np.float32)
    flats.append(w)
    params = jax.device_put(P.unflatten_params(w, p0), p_sh)
    ck.save(t, state._replace(params=params, step=state.step + t),
            {"batches": t, "version": t}, force=True)
  ck.close()
  return {"workdir": str(workdir), "d1": d1, "d2": d2, "flats": flats, "like": p0,
          "config": config}


def test_checkpoints_load_params_only_and_exactly(planted_run):
  wd = planted_run["workdir"]
  assert R.checkpoint_steps(wd) == list(STEPS)
  steps, trees = R.load_all_params(wd)
  assert steps == list(STEPS)
  assert jax.tree.structure(trees[0]) == jax.tree.structure(planted_run["like"])
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(trees[0]))
  for tree, flat in zip(trees, planted_run["flats"]):
    np.testing.assert_array_equal(P.flatten_params(tree), flat)
  assert R.load_meta(wd, 3) == {"batches": 3, "version": 3}
  assert R.read_config(wd).model.hidden_size == 128


@pytest.mark.parametrize("method", ["gram", "lanczos"])
def test_pca_recovers_planted_directions_from_saved_checkpoints(planted_run, method):
  _, trees = R.load_all_params(planted_run["workdir"])
  x = P.stack_checkpoints(trees)
  assert x.shape == (len(STEPS), planted_run["d1"].size)   # W ~ 0.8M: W×W would be 2.6 TB
  res = P.top_components(x, k=2, method=method, chunk=100_003)
  d1, d2 = planted_run["d1"], planted_run["d2"]
  c1, c2 = res.components
  assert c1 @ d1 > 0.999          # oriented along the way training moved (+d1)
  assert abs(c2 @ d2) > 0.999
  np.testing.assert_allclose(np.linalg.norm(res.components, axis=1), 1.0, rtol=1e-6)
  assert abs(c1 @ c2) < 1e-6
  # Exact variances of the planted motion: λ1 = DRIFT² Σ(t - t̄)², λ2 = WOBBLE² Σ(±1 - mean)².
  t = np.asarray(STEPS, np.float64)
  s = (-1.0) ** t
  np.testing.assert_allclose(res.eigenvalues, [DRIFT ** 2 * ((t - t.mean()) ** 2).sum(),
                                               WOBBLE ** 2 * ((s - s.mean()) ** 2).sum()],
                             rtol=1e-3)
  np.testing.assert_allclose(res.projections[:, 0], DRIFT * (t - t.mean()), atol=1e-2)
  assert res.explained.sum() > 0.999


def test_gram_matches_lanczos_and_the_full_svd_baseline():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((7, 3001)).astype(np.float32)
  g = P.top_components(x, k=2, method="gram", chunk=500)
  lz = P.top_components(x, k=2, method="lanczos", chunk=700)
  xc = x.astype(np.float64) - x.astype(np.float64).mean(0)
  _, sv, vt = np.linalg.svd(xc, full_matrices=False)
  np.testing.assert_allclose(g.eigenvalues, sv[:2] ** 2, rtol=1e-9)
  np.testing.assert_allclose(lz.eigenvalues, sv[:2] ** 2, rtol=1e-8)
  np.testing.assert_allclose(np.abs(g.components @ vt[:2].T), np.eye(2), atol=1e-8)
  np.testing.assert_allclose(g.components, lz.components, atol=1e-6)
  np.testing.assert_allclose(g.explained, sv[:2] ** 2 / (sv ** 2).sum(), rtol=1e-9)


def test_pca_rejects_too_few_or_identical_checkpoints():
  with pytest.raises(ValueError, match="at least k \\+ 1 = 3 checkpoints"):
    P.top_components(np.zeros((2, 10)), k=2)
  same = np.tile(np.arange(10.0), (4, 1))
  with pytest.raises(ValueError, match="fewer than k=2 directions"):
    P.top_components(same, k=2)
  with pytest.raises(ValueError, match="method must be"):
    P.top_components(np.random.default_rng(0).standard_normal((4, 10)), method="svd")
  with pytest.raises(ValueError, match="checkpoint 1 has a different"):
    P.stack_checkpoints([{"a": np.zeros(3)}, {"a": np.zeros(4)}])


def test_grid_is_in_units_of_checkpoint_spread_and_perturb_moves_exactly_that_far():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((6, 400))
  res = P.top_components(x, k=2)
  np.testing.assert_allclose(res.std, res.projections.std(axis=0), rtol=1e-9)
  a1, a2 = P.perturbation_grid(res, [-2, 0, 1.5], [1])
  np.testing.assert_allclose(a1, [-2 * res.std[0], 0, 1.5 * res.std[0]])
  np.testing.assert_allclose(a2, [res.std[1]])
  w_star = x[-1]
  w = P.perturb(w_star, res.components, (a1[0], a2[0]))
  np.testing.assert_allclose(res.components @ (w - w_star), [a1[0], a2[0]], atol=1e-9)
  tree = {"b": np.zeros((2, 3), np.float32), "a": np.arange(4, dtype=np.int32)}
  back = P.unflatten_params(P.flatten_params(tree) + 1, tree)
  np.testing.assert_array_equal(back["b"], np.ones((2, 3)))
  assert back["a"].dtype == np.int32 and back["a"].tolist() == [1, 2, 3, 4]


def test_fit_reward_against_log_length():
  length = np.array([[4.0, 8.0], [16.0, 32.0]])
  reward = 0.25 * np.log(length) - 0.1
  fit = ld.fit_reward_log_length(reward, length)
  assert fit["slope"] == pytest.approx(0.25) and fit["intercept"] == pytest.approx(-0.1)
  assert fit["r2"] == pytest.approx(1.0) and fit["n"] == 4
  noisy = ld.fit_reward_log_length(reward + [[0.05, -0.05], [-0.05, 0.05]], length)
  assert 0 < noisy["r2"] < 1
  flat = ld.fit_reward_log_length([0.1, 0.2], [10, 10])
  assert np.isnan(flat["slope"]) and flat["n"] == 2


def test_grid_evaluation_on_the_tiny_model_switches_weights_without_recompiling(planted_run):
  from magistral_jax import config as config_lib
  from magistral_jax.data.prompts import system_prompt_for
  from magistral_jax.generate.config import SamplingConfig
  config = planted_run["config"]
  model_cfg, tok = R.model_and_tokenizer(config)
  steps, trees = R.load_all_params(planted_run["workdir"])
  x = P.stack_checkpoints(trees)
  res = P.top_components(x, k=2)
  a1, a2 = P.perturbation_grid(res, [-1, 0, 1])
  problems = ld.prompt_set(config, 3)
  sampling = SamplingConfig(temperature=1.0, max_new_tokens=24, eos_id=tok.eos_id)
  with ld.GridScorer(model_cfg, tok, config_lib.validate(config).reward, problems, trees[-1],
                     sampling=sampling, samples_per_prompt=2,
                     system_prompt=system_prompt_for(config.system_prompt),
                     max_concurrent_decodes=8, max_prefill_length=64) as scorer:
    first = scorer.score(trees[-1])                  # compiles the engine's programs
    compiled = scorer.engine.compile_counts()
    grid = ld.evaluate_grid(scorer, x[-1], res.components, a1, a2, trees[-1])
    again = scorer.score(trees[-1])
    # Nine weight swaps through update_params and not one more compiled program.
    assert scorer.engine.compile_counts() == compiled
  assert set(grid) == {"reward", "length", "accuracy", "format_rate", "logprob"}
  for v in grid.values():
    assert v.shape == (3, 3) and np.isfinite(v).all()
  assert ((grid["length"] >= 1) & (grid["length"] <= 24)).all()
  assert ((grid["reward"] >= -0.2) & (grid["reward"] <= 1.2)).all()
  # Same seeds for every point: the centre (w* itself) scores the same when re-scored, and the
  # perturbed points really ran other weights (the log-probs of their samples differ; a random
  # init's near-uniform logits may still draw the same tokens).
  for r in (first, again):
    assert r["length"] == grid["length"][1, 1] and r["reward"] == grid["reward"][1, 1]
    assert r["logprob"] == pytest.approx(grid["logprob"][1, 1], abs=1e-6)
    assert r["num_samples"] == 6
  assert len(np.unique(np.round(grid["logprob"], 6))) == 9


def test_run_errors_name_the_missing_thing(tmp_path):
  with pytest.raises(R.RunError, match="does not exist.*launch/train.py"):
    R.checkpoint_steps(tmp_path / "nope")
  with pytest.raises(R.RunError, match="checkpoints is missing"):
    R.checkpoint_steps(tmp_path)
  with pytest.raises(R.RunError, match="config.json is missing"):
    R.read_config(tmp_path)
  (tmp_path / "checkpoints").mkdir()
  with pytest.raises(R.RunError, match="no checkpoints in"):
    R.load_all_params(tmp_path)
  with pytest.raises(R.RunError, match="step 5 not found"):
    R.load_params(tmp_path, 5)
  config = _tiny_config()
  config.data.source = "gsm8k"
  with pytest.raises(ValueError, match="data.source='gsm8k'"):
    ld.prompt_set(config, 4)


def test_metrics_rows_split_dedupe_and_panels(tmp_path):
  rows = [{"step": 25, "time": 0, "sft/loss": 2.0},
          {"step": 1, "time": 1, "reward": 0.1, "clip_high_frac": 0.0, "clip_low_frac": 0.01},
          {"step": 2, "time": 2, "reward": 0.2, "entropy": 1.0},
          {"step": 2, "time": 3, "reward": 0.3, "entropy": 0.9}]   # resumed: re-logged step 2
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.write("\n".join(json.dumps(r) for r in rows) + "\n" + '{"step": 3, "rew')   # torn tail
  sft, rl = report.load_run_metrics(tmp_path)
  assert [r["step"] for r in sft] == [25] and [r["step"] for r in rl] == [1, 2]
  steps, reward = report.series(rl, "reward")
  assert steps.tolist() == [1, 2] and reward.tolist() == [0.1, 0.3]
  assert report.panel_keys(rl, report.PANELS["clip fractions"]) == ["clip_high_frac",
                                                                    "clip_low_frac"]
  assert report.panel_keys(rl, report.PANELS["version lag (policy versions)"]) == []
  table = {r["metric"]: r for r in report.summary_table(rl)}
  assert table["reward"]["last"] == 0.3 and table["entropy"]["n"] == 1
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.write('{"step": 1}\nnot json\n{"step": 2}\n')
  with pytest.raises(R.RunError, match="metrics.jsonl:2"):
    R.read_metrics(tmp_path)


def test_ablation_curves_draw_one_line_per_variant_over_its_common_batches():
  import matplotlib
  matplotlib.use("Agg")
  from magistral_jax.analysis.plots import ablation_curves
  seed = lambda n: {"reward": [0.1 * i for i in range(n)], "entropy": [1.0] * n,
                    "time": [2.0 * i for i in range(n)]}
  fig = ablation_curves("clip", {"eps_high_0.28": [seed(4), seed(3)], "eps_high_0.20": [seed(5)]})
  reward, entropy, by_time = fig.axes
  assert [len(l.get_xdata()) for l in reward.lines] == [3, 5]   # the shortest seed's batches
  assert [l.get_label() for l in by_time.lines] == ["eps_high_0.28", "eps_high_0.20"]
  assert list(by_time.lines[1].get_xdata()) == [0.0, 2.0, 4.0, 6.0, 8.0]
