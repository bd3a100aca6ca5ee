"""Generation engine and loop on a tiny random decoder (8 simulated CPU devices)."""
import collections
import dataclasses
import queue
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magistral_jax.generate import sampling as S, xla_cpu
from magistral_jax.generate.config import EngineConfig, SamplingConfig
from magistral_jax.generate.engine import Engine
from magistral_jax.generate.loop import DIRECT, GeneratorLoop
from magistral_jax.generate.requests import GeneratorError, Request, request_key
from magistral_jax.generate.weights import NonFiniteError, ParamsMismatchError
from magistral_jax.generate.xla_cpu import tune_generate
from magistral_jax.model import transformer as T
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import make_mesh

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
GREEDY = SamplingConfig(greedy=True, max_new_tokens=8)
SAMPLED = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=8)


def opts(**kw) -> EngineConfig:
  """A loop's options: a bare loop's (generate.loop.DIRECT: prefill in the loop thread) but `kw`."""
  return dataclasses.replace(DIRECT, **kw)


@pytest.fixture(scope="module")
def params():
  # Scaled-up init so the tiny model's distributions are peaked enough to make argmax stable.
  init = jax.jit(lambda k: jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x,
                                        T.init_params(CFG, k)))
  return init(jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def mesh():
  return make_mesh({"tensor": 2}, jax.devices()[:2])


_ENGINES = {}


def engine(mesh, slots=4, sampling=GREEDY, **kw):
  # Engines are cached per configuration so their compiled programs are reused across tests.
  key = (id(mesh), slots, sampling, tuple(sorted(kw.items())))
  if key not in _ENGINES:
    _ENGINES[key] = Engine(CFG, mesh, max_concurrent_decodes=slots, max_prefill_length=16,
                           max_decode_length=16, sampling=sampling, prefill_buckets=(8, 16), **kw)
  return _ENGINES[key]


def prompts(n, seed=0):
  rs = np.random.RandomState(seed)
  return [rs.randint(1, CFG.vocab_size, rs.randint(3, 14)).tolist() for _ in range(n)]


def run(loop, requests):
  for r in requests:
    loop.submit(r)
  return {(c.request_id, c.sample_index): c for c in loop.run_until_idle()}


PAD_TO = 32  # the scoring forward is causal: right padding leaves earlier positions unchanged


@jax.jit
def _score(params, seq):
  h = T.hidden_states(params, CFG, seq)
  # The trainer's π_θ: token_logprobs at temperature T over the untruncated softmax.
  lp = T.token_logprobs(params, CFG, h[:, :-1], seq[:, 1:], temperature=SAMPLED.temperature)
  return T.logits(params, CFG, h)[0], lp[0]


def score(params, seq):
  """(full-forward logits [len, V], trainer log-probs of seq[1:] at T=0.7) for one sequence."""
  lg, lp = _score(params, jnp.asarray([seq + [0] * (PAD_TO - len(seq))]))
  return np.asarray(lg[:len(seq)]), np.asarray(lp[:len(seq) - 1])


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 3])
def test_a_request_key_is_jax_s_key_computed_on_the_host(seed):
  """submit may run in any thread, so it computes the key without a device op: the same key."""
  np.testing.assert_array_equal(request_key(seed), np.asarray(jax.random.PRNGKey(seed)))
  assert request_key(seed).dtype == np.uint32


def test_greedy_equals_argmax_of_full_forward_step_by_step(params, mesh):
  loop = GeneratorLoop(engine(mesh), params, sampling=GREEDY)
  for p in prompts(2):
    c = run(loop, [Request("a", p, max_new_tokens=10)])["a", 0]
    lg, _ = score(params, p + c.tokens)
    expected = np.argmax(lg[len(p) - 1:-1], axis=-1).tolist()
    assert c.tokens == expected


def test_sampled_logprobs_equal_trainer_recomputed_logprobs(params, mesh):
  loop = GeneratorLoop(engine(mesh, sampling=SAMPLED), params, sampling=SAMPLED)
  ps = prompts(3, seed=1)
  out = run(loop, [Request(i, p, group_size=2) for i, p in enumerate(ps)])
  for (i, _), c in out.items():
    _, lp = score(params, ps[i] + c.tokens)
    recomputed = lp[len(ps[i]) - 1:]
    np.testing.assert_allclose(c.logprobs, recomputed, rtol=0, atol=2e-5)


def test_continuous_batching_matches_one_at_a_time(params, mesh):
  ps = prompts(7, seed=2)
  reqs = lambda: [Request(i, p, group_size=2, max_new_tokens=2 + i, seed=i)
                  for i, p in enumerate(ps)]
  for sampling in (GREEDY, SAMPLED):
    batched_loop = GeneratorLoop(engine(mesh, sampling=sampling), params, sampling=sampling)
    batched = run(batched_loop, reqs())
    alone = {}
    for r in reqs():  # one request at a time, the engine otherwise empty
      alone.update(run(GeneratorLoop(engine(mesh, sampling=sampling), params,
                                     sampling=sampling), [r]))
    assert batched.keys() == alone.keys()
    for k in alone:
      assert batched[k].tokens == alone[k].tokens, (sampling, k)
      np.testing.assert_allclose(batched[k].logprobs, alone[k].logprobs, atol=1e-5)
    # 14 samples of 2..8 tokens through 4 slots: freed slots were refilled, not left idle. With
    # overlap_host (the default) a finished sample's slot is refilled a step later (the step
    # dispatched before its finish was known computes a token that is dropped): on samples this
    # short that is a sixth of the slot-steps, on RL-length ones a fraction of a percent.
    assert batched_loop.metrics()["slot_utilization"] > 0.65
    sync_loop = GeneratorLoop(engine(mesh, sampling=sampling), params,
                              options=opts(overlap_host=False), sampling=sampling)
    sync = run(sync_loop, reqs())
    assert all(sync[k].tokens == batched[k].tokens for k in alone)
    assert sync_loop.metrics()["slot_utilization"] > 0.8


def test_group_samples_share_one_prefill(params, mesh):
  eng = engine(mesh, sampling=SAMPLED)
  loop = GeneratorLoop(eng, params, sampling=eng.sampling)
  calls = []
  orig = eng.prefill_many
  eng.prefill_many = lambda p, tokens, n: calls.append(len(tokens)) or orig(p, tokens, n)
  try:
    out = run(loop, [Request("g", prompts(1)[0], group_size=6, max_new_tokens=8)])
  finally:
    del eng.prefill_many
  assert calls == [1] and len(out) == 6  # 6 samples, 4 slots, one prompt prefilled once
  assert len({tuple(c.tokens) for c in out.values()}) > 1  # independent per-slot streams


def test_weight_update_mid_generation_tags_versions_without_recompiling(params, mesh):
  eng = engine(mesh)
  # compact_drain off: the one request decodes on the full engine (whose step it counts), not
  # on a compacted one, whatever ran before this test.
  loop = GeneratorLoop(eng, params, version=3, compact_drain=False, sampling=eng.sampling)
  p = prompts(1, seed=3)[0]
  loop.submit(Request("x", p, max_new_tokens=12))
  for _ in range(4):
    loop.step()
  before = eng.compile_counts()
  new = jax.tree.map(lambda x: x * 0.5, params)
  loop.update_params(new, 4)
  c = loop.run_until_idle()[0]
  assert c.finish_reason == "length" and len(c.tokens) == 12
  # Prefill token + 4 steps sampled under v3; the rest under v4.
  assert c.versions.tolist() == [3] * 5 + [4] * 7
  assert eng.compile_counts() == before
  assert eng.compile_counts()["generate"] == 1
  assert loop.counters.update_pause_steps == [0]
  # After the switch, tokens follow the new weights on top of the old (kept) KV cache, so they
  # are not what the old weights would have produced.
  old_only = run(GeneratorLoop(eng, params, sampling=eng.sampling),
                 [Request("y", p, max_new_tokens=12)])["y", 0]
  assert old_only.tokens[:5] == c.tokens[:5] and old_only.tokens != c.tokens


@pytest.mark.parametrize("shared", [False, True])
def test_recompute_kv_on_update_equals_fresh_prefill_under_new_weights(params, mesh, shared):
  eng = engine(mesh)
  new = jax.tree.map(lambda x: x * 0.5, params)
  p = prompts(1, seed=4)[0]
  if shared:   # a prompt continuing the loop's shared prefix (SHARED, defined below)
    p = SHARED + p[:6]
  loop = GeneratorLoop(eng, params, options=opts(recompute_kv_on_update=True),
                       shared_prefix=SHARED if shared else None, sampling=eng.sampling)
  loop.submit(Request("x", p, max_new_tokens=10))
  for _ in range(3):
    loop.step()
  loop.update_params(new, 1)
  c = loop.run_until_idle()[0]
  head = c.tokens[:4]
  # With the cache recomputed, the continuation is exactly greedy under the new weights from
  # prompt + the 4 tokens sampled before the switch.
  fresh = run(GeneratorLoop(eng, new, sampling=eng.sampling),
              [Request("y", p + head[:-1], max_new_tokens=7)])["y", 0]
  assert c.tokens[3:] == fresh.tokens
  assert c.versions.tolist() == [0] * 4 + [1] * 6


def test_bad_weight_updates_are_rejected_and_generation_continues(params, mesh):
  loop = GeneratorLoop(engine(mesh), params, sampling=GREEDY)
  p = prompts(1, seed=5)[0]
  loop.submit(Request("x", p, max_new_tokens=6))
  loop.step()
  wrong_shape = jax.tree.map(lambda x: x, params)
  wrong_shape["final_norm"]["scale"] = jnp.ones((CFG.hidden_size + 1,))
  with pytest.raises(ParamsMismatchError, match=r"final_norm.*\(33,\) != \(32,\)"):
    loop.update_params(wrong_shape, 1)
  wrong_tree = {k: v for k, v in params.items() if k != "final_norm"}
  with pytest.raises(ParamsMismatchError, match="tree structure"):
    loop.update_params(wrong_tree, 1)
  nan = jax.tree.map(lambda x: x, params)
  nan["final_norm"]["scale"] = nan["final_norm"]["scale"].at[0].set(jnp.nan)
  with pytest.raises(NonFiniteError):
    loop.update_params(nan, 1)
  # A version that does not move forward: tokens (and the shared prefix's cache) are keyed by it.
  with pytest.raises(ValueError, match="version 0 must be greater than .* latest version 0"):
    loop.update_params(params, 0)
  c = loop.run_until_idle()[0]
  assert c.versions.tolist() == [0] * 6 and len(c.tokens) == 6
  ref = run(GeneratorLoop(engine(mesh), params, sampling=GREEDY),
            [Request("y", p, max_new_tokens=6)])["y", 0]
  assert c.tokens == ref.tokens


def test_bad_prompts_are_rejected_or_truncated(params, mesh):
  loop = GeneratorLoop(engine(mesh), params, sampling=GREEDY)
  with pytest.raises(ValueError, match="empty prompt"):
    loop.submit(Request("e", []))
  with pytest.raises(ValueError, match="'long'.*20 tokens, more than max_prefill_length=16"):
    loop.submit(Request("long", list(range(1, 21))))
  with pytest.raises(ValueError, match="token ids"):
    loop.submit(Request("oov", [1, CFG.vocab_size]))
  with pytest.raises(ValueError, match="max_new_tokens"):
    loop.submit(Request("mx", [1, 2], max_new_tokens=17))
  with pytest.raises(ValueError, match="max_new_tokens=0 outside"):  # not "the default"
    loop.submit(Request("zero", [1, 2], max_new_tokens=0))
  with pytest.raises(ValueError, match="'g0': group_size must be >= 1, got 0"):
    loop.submit(Request("g0", [1, 2], group_size=0))
  assert loop.idle()  # nothing half-queued
  tloop = GeneratorLoop(engine(mesh), params, truncate_prompts=True, sampling=GREEDY)
  c = run(tloop, [Request("long", list(range(1, 21)), max_new_tokens=2)])["long", 0]
  assert c.prompt_truncated and c.prompt_tokens == list(range(5, 21))


def test_nan_params_stop_generation_with_an_error(params, mesh):
  nan = jax.tree.map(lambda x: x, params)
  nan["layers"]["mlp"]["down_proj"]["kernel"] = \
      nan["layers"]["mlp"]["down_proj"]["kernel"].at[0, 0, 0].set(jnp.nan)
  with pytest.raises(NonFiniteError):
    GeneratorLoop(engine(mesh), nan, sampling=GREEDY)
  # Weights corrupted behind the loop's back (bypassing validation): the decode step's logit
  # check stops the threaded loop, and the caller gets the error instead of garbage or a hang.
  bad = jax.device_put(T.to_decode_layout(nan), engine(mesh).decode_param_shardings)
  loop = GeneratorLoop(engine(mesh), params, sampling=GREEDY)
  ps = prompts(6, seed=11)
  for i, p in enumerate(ps[:4]):
    loop.submit(Request(i, p, max_new_tokens=6))
  loop.step()   # the 4 slots hold samples; the next requests wait for a slot
  loop.weights.params = bad
  for i, p in enumerate(ps[4:], 4):
    loop.submit(Request(i, p, max_new_tokens=6))
  loop.start()
  with pytest.raises(GeneratorError, match="non-finite logits in slots") as e:
    loop.get(timeout=60)
  assert isinstance(e.value.__cause__, NonFiniteError)
  loop.stop()
  # A sample that would finish on its first token: that token's logits are checked too (the
  # prompt's last position), so no completion with a NaN log-prob reaches the trainer.
  first = GeneratorLoop(engine(mesh), params, sampling=GREEDY)
  first.weights.params = bad
  first.submit(Request("one", prompts(1)[0], max_new_tokens=1))
  with pytest.raises(NonFiniteError, match=r"prompt logits for requests \['one'\]"):
    first.step()
  assert first.completions.empty()
  # With the background prefill worker: when the loop thread dies the worker stops with it.
  # (prefill_ahead=2: a live worker would keep waiting for the dead loop to take its backlog.)
  bg = GeneratorLoop(engine(mesh), params, options=opts(background_prefill=True), prefill_ahead=2,
                     sampling=GREEDY)
  bg.weights.params = bad
  for i, p in enumerate(prompts(24, seed=12)):
    bg.submit(Request(i, p, max_new_tokens=6))
  bg.start()
  with pytest.raises(GeneratorError, match="non-finite"):
    bg.get(timeout=60)
  deadline = time.monotonic() + 30
  while bg.parts.prefiller.thread is not None and time.monotonic() < deadline:
    time.sleep(0.01)
  assert bg.parts.prefiller.thread is None, "the prefill worker outlived the loop thread"
  bg.stop(timeout=30)


def test_stop_waits_for_a_step_and_never_drops_a_running_thread(params, mesh):
  release = threading.Event()
  loop = GeneratorLoop(engine(mesh), params, callback=lambda c: release.wait(30), sampling=GREEDY)
  loop.submit(Request("x", prompts(1)[0], max_new_tokens=2))
  loop.start()
  deadline = time.monotonic() + 60
  # Until inside the callback.
  while loop.counters.generated_tokens < 1 and time.monotonic() < deadline:
    time.sleep(0.01)
  time.sleep(0.2)
  with pytest.raises(TimeoutError, match="still running"):
    loop.stop(timeout=0.1)
  with pytest.raises(RuntimeError, match="already started"):  # not a second thread on its state
    loop.start()
  release.set()
  loop.stop(timeout=30)
  assert loop.completions.get_nowait().request_id == "x"


def test_stop_on_eos_and_stop_strings(params, mesh):
  p = prompts(1, seed=6)[0]
  ref = run(GeneratorLoop(engine(mesh), params, sampling=GREEDY),
            [Request("r", p, max_new_tokens=8)])["r", 0]
  eos = ref.tokens[3]
  k = ref.tokens.index(eos)  # first occurrence
  c = run(GeneratorLoop(engine(mesh), params, sampling=SamplingConfig(greedy=True, eos_id=eos)),
          [Request("e", p, max_new_tokens=8)])["e", 0]
  assert c.finish_reason == "eos" and c.tokens == ref.tokens[:k + 1]
  detok = lambda ids: "".join(f"<{i}>" for i in ids)
  stop = f"<{ref.tokens[1]}><{ref.tokens[2]}>"
  sc = SamplingConfig(greedy=True, stop_strings=(stop,))
  with pytest.raises(ValueError, match="detokenize"):
    GeneratorLoop(engine(mesh), params, sampling=sc)
  with pytest.raises(ValueError, match="top_p"):   # compiled into the engine's programs
    GeneratorLoop(engine(mesh), params, sampling=SamplingConfig(greedy=True, top_p=0.5))
  c = run(GeneratorLoop(engine(mesh), params, sampling=sc, detokenize=detok),
          [Request("s", p, max_new_tokens=8)])["s", 0]
  assert c.finish_reason == "stop" and stop in detok(c.tokens) and len(c.tokens) <= 3


# The two implementations of the truncation rule: XLA:CPU's (bisection) and jax's own (a sort).
TRUNCATIONS = pytest.mark.parametrize("truncate", [xla_cpu.truncate, S.truncate],
                                      ids=["xla_cpu", "jax"])


@TRUNCATIONS
def test_top_k_and_top_p_truncation(truncate):
  lg = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  assert np.isfinite(np.asarray(truncate(lg, 2, 1.0))).tolist() == [[True, True, False, False]]
  # Nucleus 0.75: 0.5 alone is not enough, 0.5 + 0.3 is; 0.15 and 0.05 are cut.
  assert np.isfinite(np.asarray(truncate(lg, 0, 0.75))).tolist() == [[True, True, False, False]]
  assert np.isfinite(np.asarray(truncate(lg, 0, 0.4))).tolist() == [[True, False, False, False]]
  keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(64))
  sample = jax.jit(lambda lg, k: S.sample(lg, k, jnp.zeros(64, jnp.int32),
                                          SamplingConfig(top_k=2), jnp.ones(64, jnp.float32)))
  tok, lp = sample(jnp.repeat(lg, 64, 0), keys)
  assert set(np.asarray(tok).tolist()) == {0, 1}
  # The log-prob is under the untruncated tempered policy, not renormalised over the top-k.
  np.testing.assert_allclose(np.asarray(lp), np.log(np.array([0.5, 0.3]))[np.asarray(tok)],
                             rtol=1e-6)


def _np_truncate(lg, top_k, top_p):
  """NumPy reference of xla_cpu.truncate's documented rule, by sorting (float64 masses).
  Returns (kept [rows, V], near [rows, V]): near marks tokens whose preceding mass lies within
  1e-6 of top_p, where float32 sums may round to the other side."""
  lg = np.asarray(lg, np.float64)
  out, near = lg.copy(), np.zeros(lg.shape, bool)
  for r in range(lg.shape[0]):
    row = out[r]
    if 0 < top_k < row.size:
      row[row < np.sort(row)[::-1][top_k - 1]] = -np.inf
    if top_p < 1.0:
      order = np.argsort(-row, kind="stable")
      p = np.exp(row[order] - row[order][0])
      p /= p.sum()
      before = np.cumsum(p) - p
      edge = row[order][before < top_p].min()
      row[row < edge] = -np.inf
      near[r, order] = np.abs(before - top_p) < 1e-6
  return np.isfinite(out), near


@TRUNCATIONS
@pytest.mark.parametrize("top_k,top_p", [(0, 0.1), (0, 0.5), (0, 0.95), (0, 0.999), (1, 1.0),
                                         (7, 1.0), (50, 1.0), (50, 0.9), (7, 0.3), (700, 1.0),
                                         (700, 0.8)])
def test_truncation_matches_a_numpy_reference(truncate, top_k, top_p):
  rs = np.random.RandomState(top_k * 1000 + int(top_p * 1000))
  for rows in (6, 24):   # 24 rows: truncated in blocks of TRUNCATE_BLOCK_ROWS
    lg = (rs.randn(rows, 3000) * rs.choice([0.5, 2.0, 6.0], (rows, 1))).astype(np.float32)
    lg[0] = -lg[0] - 80.0   # all logits negative: the bisection crosses the sign of the keys
    got = np.isfinite(np.asarray(jax.jit(truncate, static_argnums=(1, 2))(lg, top_k, top_p)))
    want, near = _np_truncate(lg, top_k, top_p)
    assert ((got == want) | near).all(), np.argwhere(got != want)[:5]
    assert (got == want).mean() > 0.999
    assert got.sum(-1).min() >= 1


def test_draw_follows_the_distribution_and_never_draws_an_excluded_token():
  v = 1000   # not a multiple of DRAW_BLOCK: the padding is never drawn either
  lg = jnp.asarray(np.random.RandomState(0).randn(v).astype(np.float32) * 2.0)
  lg = lg.at[::7].set(-jnp.inf)
  n = 100_000
  keys = jax.random.split(jax.random.PRNGKey(1), n)
  toks = np.asarray(jax.jit(xla_cpu.draw)(keys, jnp.broadcast_to(lg, (n, v))))
  assert toks.min() >= 0 and toks.max() < v
  p = np.asarray(jax.nn.softmax(lg))
  counts = np.bincount(toks, minlength=v)
  assert counts[::7].sum() == 0
  # Pearson chi-square over the allowed tokens: mean ~1 per degree of freedom (dof ~857, so
  # 1.2 is > 5 standard deviations away) for a correct sampler.
  ok = p > 0
  chi2 = ((counts[ok] - n * p[ok]) ** 2 / (n * p[ok])).sum() / (ok.sum() - 1)
  assert 0.8 < chi2 < 1.2, chi2
  # A one-hot row always draws its token; a row with all mass on the last token of the last block.
  one = jnp.full((4, v), -jnp.inf).at[jnp.arange(4), jnp.array([0, 255, 256, v - 1])].set(0.0)
  assert np.asarray(xla_cpu.draw(keys[:4], one)).tolist() == [0, 255, 256, v - 1]


@pytest.mark.parametrize("v", [300, 4096, 5000])   # one block, whole blocks, a padded last block
def test_blocked_argmax_equals_jnp_argmax(v):
  rs = np.random.RandomState(v)
  rows = [rs.randn(v).astype(np.float32) for _ in range(4)]
  tie = np.zeros(v, np.float32)
  tie[[v // 3, 2 * v // 3, v - 1]] = 5.0          # ties in different blocks: the first wins
  nan = rs.randn(v).astype(np.float32)
  nan[[v - 2, v // 2]] = np.nan                     # some index in range
  edge = np.full(v, -np.inf, np.float32)
  edge[v - 1] = 1.0                                 # the very last token
  lg = jnp.asarray(np.stack(rows + [tie, nan, edge, np.full(v, -np.inf, np.float32)]))
  want = np.asarray(jnp.argmax(lg, axis=-1))
  got = np.asarray(jax.jit(xla_cpu.argmax)(lg))
  assert got.dtype == np.int32 and 0 <= got[5] < v
  assert np.delete(got, 5).tolist() == np.delete(want, 5).tolist()
  assert want[4] == v // 3 and want[6] == v - 1 and want[7] == 0


@TRUNCATIONS
def test_truncation_keeps_ties_together(truncate, monkeypatch):
  lg = jnp.asarray([[2.0, 1.0, 1.0, 1.0, 0.0, -jnp.inf]])
  # top-k 2: the k-th largest value is 1.0, and every token at 1.0 stays (selection or bisection).
  assert np.isfinite(np.asarray(truncate(lg, 2, 1.0))).tolist() == [[True] * 4 + [False] * 2]
  monkeypatch.setattr(xla_cpu, "TOP_K_SELECT_MAX", 1)
  assert np.isfinite(np.asarray(truncate(lg, 2, 1.0))).tolist() == [[True] * 4 + [False] * 2]
  # Nucleus: 2.0 alone holds e / (e + 3 + 1) = 0.40 < 0.5, so the tied 1.0s come in together.
  assert np.isfinite(np.asarray(truncate(lg, 0, 0.5))).tolist() == [[True] * 4 + [False] * 2]
  assert np.isfinite(np.asarray(truncate(lg, 0, 0.3))).tolist() == [[True] + [False] * 5]


@pytest.mark.parametrize("greedy", [False, True])
def test_the_sampler_compiles_only_its_platform_s_path(greedy):
  """On CPU the program holds xla_cpu's primitives (bisection loops and padded blocks, no sort);
  lowered for a GPU or a TPU, jax's own (lax.top_k / sort over the vocabulary, jnp.argmax)."""
  cfg = SamplingConfig(top_p=0.9, greedy=greedy)
  f = jax.jit(lambda lg, k: S.sample(lg, k, jnp.zeros(4, jnp.int32), cfg, jnp.ones(4)))
  args = (jnp.zeros((4, 3000)), jax.vmap(jax.random.PRNGKey)(jnp.arange(4)))

  def ops(text):
    return set(re.findall(r"(?:stablehlo|chlo)\.[a-z_]+", text))

  cpu = ops(f.lower(*args).as_text())
  assert "stablehlo.pad" in cpu and not cpu & {"stablehlo.sort", "chlo.top_k"}
  for platform in ("cuda", "tpu"):
    other = ops(jax.export.export(f, platforms=[platform])(*args).mlir_module())
    assert "stablehlo.pad" not in other, platform
    if not greedy:
      assert other & {"stablehlo.sort", "chlo.top_k"} and "stablehlo.while" not in other


def test_threaded_loop_on_a_two_device_slice_while_another_slice_is_busy(params):
  devs = jax.devices()
  gen_mesh = make_mesh({"tensor": 2}, devs[6:8])
  eng = engine(gen_mesh)
  loop = GeneratorLoop(eng, params, sampling=eng.sampling)
  leaf = loop.params["layers"][0]["attn"]["q_proj"]["kernel"]  # decode layout: one per layer
  assert leaf.sharding.device_set == set(devs[6:8])
  assert leaf.sharding.spec[1] == "tensor"  # heads split over the slice: tensor parallel
  stop = threading.Event()
  busy = jax.jit(lambda x: jnp.tanh(x @ x))
  x = jax.device_put(jnp.ones((256, 256)), devs[0])
  def trainer():
    y = x
    while not stop.is_set():
      y = busy(y).block_until_ready()
  t = threading.Thread(target=trainer)
  t.start()
  try:
    ps = prompts(5, seed=7)
    loop.start()
    for i, p in enumerate(ps):
      loop.submit(Request(i, p, max_new_tokens=6))
    loop.update_params(jax.tree.map(lambda a: a * 0.5, params), 1)
    got = [loop.get(timeout=120) for _ in ps]
  finally:
    stop.set()
    t.join()
    loop.stop()
  assert sorted(c.request_id for c in got) == list(range(5))
  assert all(len(c.tokens) == 6 and set(c.versions.tolist()) <= {0, 1} for c in got)
  assert loop.version == 1 and eng.compile_counts()["generate"] == 1
  with pytest.raises(queue.Empty):
    loop.get(timeout=0.1)


def test_batched_prefill_and_insert_equal_the_one_at_a_time_contract(params, mesh):
  """prefill_many + insert_many (what the loop uses) give the same caches, first tokens,
  log-probs and continuations as the JetStream-contract prefill / insert."""
  eng = engine(mesh, sampling=SAMPLED)
  ps = prompts(4, seed=8)
  padded = [eng.pad_prompt(p, truncate=False) for p in ps]
  keys = [np.asarray(jax.random.PRNGKey(100 + i)) for i in range(4)]
  # Contract path: prompt i into slot 3 - i, one prefill and one insert at a time.
  one = eng.init_decode_state()
  firsts_one = {}
  for i, (pad, n, _) in enumerate(padded):
    # Only prompts that share a bucket can be batched; pad them all to 16 for this check.
    tokens16 = np.zeros(16, np.int32)
    tokens16[:n] = pad[:n]
    # Prompt 3 as sample index 1 of its request (a group's second sample): its stream is
    # fold_in(request_key, 1).
    prefix = eng.prefill(eng.load_params(params), tokens16, n, temperature=SAMPLED.temperature,
                         rng=jax.random.fold_in(keys[i], 1 if i == 3 else 0))
    firsts_one[3 - i] = (int(prefix.token), float(prefix.logprob))
    one = eng.insert(prefix, one, 3 - i)
  # Batched path: one prefill of 4 rows, one insert into the 4 slots.
  p = eng.load_params(params)
  tokens = np.zeros((4, 16), np.int32)
  for i, (pad, n, _) in enumerate(padded):
    tokens[i, :n] = pad[:n]
  pre = eng.prefill_many(p, tokens, [n for _, n, _ in padded])
  many, tok, lp = eng.insert_many(pre, eng.init_decode_state(), [3, 2, 1, 0], [0, 1, 2, 3],
                                  np.stack(keys), [0, 0, 0, 1], np.ones(4, bool),
                                  temperature=SAMPLED.temperature)
  for j, slot in enumerate([3, 2, 1, 0]):
    assert int(tok[j]) == firsts_one[slot][0]
    np.testing.assert_allclose(float(lp[j]), firsts_one[slot][1], atol=1e-5)
  np.testing.assert_array_equal(np.asarray(many.cache.lengths), np.asarray(one.cache.lengths))
  for step in range(3):
    one, r1 = eng.generate(p, one)
    many, r2 = eng.generate(p, many)
    np.testing.assert_array_equal(np.asarray(r1.tokens), np.asarray(r2.tokens))
    np.testing.assert_allclose(np.asarray(r1.logprobs), np.asarray(r2.logprobs), atol=1e-5)
  with pytest.raises(ValueError, match="not one of"):
    eng.prefill_many(p, tokens[:3], [3, 3, 3])
  with pytest.raises(ValueError, match="padded length 5 is not a bucket"):
    eng.prefill_many(p, tokens[:2, :5], [3, 3])
  with pytest.raises(ValueError, match=r"true_lengths \[0, 3\] outside"):
    eng.prefill_many(p, tokens[:2], [0, 3])
  with pytest.raises(ValueError, match="distinct"):
    eng.insert_many(pre, many, [0, 0], [0, 1], np.stack(keys[:2]), [0, 0], np.ones(4, bool),
                    temperature=SAMPLED.temperature)


def test_loop_prefills_waiting_requests_together(params, mesh):
  eng = engine(mesh, sampling=SAMPLED)
  calls = []
  orig = eng.prefill_many
  eng.prefill_many = lambda p, tokens, n: calls.append(len(tokens)) or orig(p, tokens, n)
  ps = [p for p in prompts(12, seed=9) if len(p) <= 8][:3]  # one bucket
  try:
    out = run(GeneratorLoop(eng, params, sampling=eng.sampling),
              [Request(i, p, group_size=2 if i == 0 else 1, max_new_tokens=3)
               for i, p in enumerate(ps)])
  finally:
    del eng.prefill_many
  # 4 free slots: request 0 (2 samples) and requests 1 and 2 fill them; 3 prompts -> 2 + 1.
  assert calls == [2, 1] and len(out) == 4
  # Programs are per (bucket, prefill batch size), never per number of inserted samples.
  bound = len(eng.prefill_batch_sizes) * len(eng.prefill_buckets)
  assert eng.compile_counts()["insert_many"] <= bound
  assert eng.compile_counts()["prefill_many"] <= bound


def test_generate_compiler_options_by_slot_count():
  """Untuned, the CPU generate step drops YNNPACK below CPU_GENERATE_YNN_MIN_SLOTS slots and keeps
  the defaults from there on; a named library overrides the rule; other platforms always keep
  the defaults; an unknown library is an error."""
  from magistral_jax.generate import xla_cpu as C
  assert C.generate_compiler_options("cpu", 16) == C.CPU_GENERATE_COMPILER_OPTIONS
  assert C.generate_compiler_options("cpu", C.CPU_GENERATE_YNN_MIN_SLOTS - 1) is not None
  assert C.generate_compiler_options("cpu", C.CPU_GENERATE_YNN_MIN_SLOTS) is None
  assert C.generate_compiler_options("cpu", 64) is None
  assert C.generate_compiler_options("cpu", 16, "ynnpack") is None
  assert C.generate_compiler_options("cpu", 64, "eigen") == C.CPU_GENERATE_COMPILER_OPTIONS
  assert C.generate_compiler_options("gpu", 16) is None
  with pytest.raises(ValueError, match="dot library"):
    C.generate_compiler_options("cpu", 16, "mkl")


def test_cpu_options_come_in_one_object_and_the_dot_library_is_ignored_off_cpu(mesh):
  """Engine(cpu=CpuOptions(...)) is what the keywords cpu_dot_library / compact_sizes spell (not
  both at once); the child engines keep the dot library and compact no further. Off CPU the
  generate step is compiled once, with the default options, and never tuned."""
  from magistral_jax.generate.xla_cpu import CpuOptions
  from magistral_jax.generate.xla_cpu import GenerateStep
  eng = engine(mesh, slots=8, cpu=CpuOptions("ynnpack", compact_sizes=(2,)))
  same = engine(mesh, slots=8, cpu_dot_library="ynnpack", compact_sizes=(2,))
  assert eng.cpu == same.cpu and eng.compact_sizes == (2,) and eng.generate_library == "ynnpack"
  child = eng.compact_engine(2)
  assert child.compact_sizes == () and child.generate_library == "ynnpack"
  with pytest.raises(ValueError, match="either"):
    Engine(CFG, mesh, max_concurrent_decodes=2, max_prefill_length=8, max_decode_length=8,
           cpu=CpuOptions(), compact_sizes=())
  compiled = []
  step = GenerateStep(lambda options: compiled.append(options) or object(), "gpu", 8, "auto")
  assert step.library is None and not step.tunable and compiled == [None]
  assert step.tune(None, lambda: None, 32) is None and step.tuning is None


def test_tune_generate_picks_a_dot_library_and_both_agree(params, mesh):
  """precompile times the generate step with YNNPACK and with Eigen and keeps the faster; the
  two programs compute the same step (greedy tokens equal, log-probs to fp32 rounding), and
  generating afterwards compiles nothing new. A fixed library is never tuned; a bad one is an
  error."""
  with pytest.raises(ValueError, match="cpu_dot_library"):
    Engine(CFG, mesh, max_concurrent_decodes=2, max_prefill_length=8, max_decode_length=8,
           cpu_dot_library="blas")
  fixed = engine(mesh, slots=2, cpu_dot_library="ynnpack")
  assert tune_generate(fixed, fixed.load_params(params)) is None
  assert fixed.generate_library == "ynnpack" and fixed.generate_tuning is None

  eng = engine(mesh, slots=4, cpu_dot_library="auto")
  p = eng.load_params(params)
  eng.precompile(p)
  for n in eng.compact_sizes:  # the drain's engines are tuned too
    assert eng.compact_engine(n).generate_tuning["chosen"] in ("ynnpack", "eigen")
  tuning = eng.generate_tuning
  assert tuning["chosen"] == eng.generate_library in ("ynnpack", "eigen")
  assert set(tuning["step_ms"]) == {"ynnpack", "eigen"}
  assert all(t > 0 for t in tuning["step_ms"].values())
  assert eng.compile_counts()["generate"] == 2
  before = eng.compile_counts()   # compaction programs included: the drain compiles nothing
  out = run(GeneratorLoop(eng, params, sampling=eng.sampling), [Request(i, q, max_new_tokens=6)
                                         for i, q in enumerate(prompts(3, seed=5))])
  assert eng.compile_counts() == before and len(out) == 3

  # The same decode steps through both programs.
  padded, n, _ = eng.pad_prompt(prompts(1, seed=6)[0])
  outs = {}
  for lib in ("ynnpack", "eigen"):
    pre = eng.prefill_many(p, padded[None], [n])
    st, _, _ = eng.insert_many(pre, eng.init_decode_state(), [0], [0],
                               np.zeros((1, 2), np.uint32), [0], np.array([True] + [False] * 3),
                               temperature=GREEDY.temperature)
    toks, lps = [], []
    for _ in range(5):
      st, r = eng.generate_step.jit(lib)(p, st, eng.cache_length)
      toks.append(int(r.tokens[0]))
      lps.append(float(r.logprobs[0]))
    outs[lib] = (toks, lps)
  assert outs["ynnpack"][0] == outs["eigen"][0]
  np.testing.assert_allclose(outs["ynnpack"][1], outs["eigen"][1], atol=1e-4)

def test_drain_compaction_gives_the_same_samples_on_fewer_slots(params, mesh):
  """Once nothing waits and few slots are active, the loop decodes them on a smaller engine
  (8 slots -> 4 -> 2 here) and writes them back when new work arrives; every sample, greedy or
  sampled, is the one the full-size step gives, and its log-probs agree."""
  ps = prompts(9, seed=11)
  reqs = lambda: [Request(i, p, max_new_tokens=3 + (5 * i) % 14, seed=i)
                  for i, p in enumerate(ps)]
  for sampling in (GREEDY, SAMPLED):
    eng = engine(mesh, slots=8, sampling=sampling)
    assert eng.compact_sizes == (4, 2)
    full_loop = GeneratorLoop(eng, params, compact_drain=False, sampling=eng.sampling)
    full = run(full_loop, reqs())
    loop = GeneratorLoop(eng, params, sampling=eng.sampling)
    got = run(loop, reqs()[:7])
    assert loop.counters.compact_steps > 0 and full_loop.counters.compact_steps == 0
    # Mid-drain (compacted), new requests arrive: the loop expands and refills.
    rs = reqs()
    loop.submit(rs[7])
    while loop.parts.drain.compacted is None:
      loop.step()
    loop.submit(rs[8])
    got.update(run(loop, []))
    assert got.keys() == full.keys()
    for k in full:
      assert got[k].tokens == full[k].tokens, (sampling, k)
      np.testing.assert_allclose(got[k].logprobs, full[k].logprobs, atol=1e-5)
    # Utilisation: over all 8 slots every step, and over the slots each step computed (the
    # compacted steps compute 4 or 2). Without compaction the two are the same.
    m, fm = loop.metrics(), full_loop.metrics()
    assert m["compact_steps"] == loop.counters.compact_steps and fm["compact_steps"] == 0
    assert full_loop.counters.computed_slot_steps == 8 * full_loop.counters.steps
    assert fm["computed_slot_utilization"] == pytest.approx(fm["slot_utilization"])
    c = loop.counters
    assert 8 * (c.steps - c.compact_steps) < c.computed_slot_steps < 8 * c.steps
    assert m["computed_slot_utilization"] == pytest.approx(
        loop.counters.active_slot_steps / loop.counters.computed_slot_steps)
    assert m["slot_utilization"] < m["computed_slot_utilization"] <= 1.0


def test_compact_and_expand_round_trip_and_reject_bad_slots(params, mesh):
  eng = engine(mesh, slots=8)
  p = eng.load_params(params)
  loop = GeneratorLoop(eng, params, compact_drain=False, sampling=eng.sampling)
  for i, q in enumerate(prompts(5, seed=12)):
    loop.submit(Request(i, q, max_new_tokens=10))
  loop.step()
  loop.step()
  before = jax.device_get(loop.state)
  slots = [4, 1, 3]
  small = eng.compact(loop.state, slots)
  assert small.tokens.shape == (4,) and jax.device_get(small.active).tolist() == [
      bool(before.active[s]) for s in slots] + [False]
  for a, b in zip(jax.tree.leaves(jax.device_get(small.cache.k)),
                  jax.tree.leaves(before.cache.k)):
    np.testing.assert_array_equal(a[:3], b[slots])
  # One step on the small engine, then back: those slots advanced, the others are untouched.
  small, _ = eng.compact_engine(4).generate(p, small)
  state = eng.expand(loop.state, small, [4, -1, 3])
  after = jax.device_get(state)
  assert after.cache.lengths[4] == before.cache.lengths[4] + 1
  assert after.cache.lengths[1] == before.cache.lengths[1]   # -1: not written back
  assert after.cache.lengths[3] == before.cache.lengths[3] + 1
  np.testing.assert_array_equal(after.cache.k[0][[0, 2, 5, 6, 7]],
                                before.cache.k[0][[0, 2, 5, 6, 7]])
  assert not after.cache.k[0][4].tolist() == before.cache.k[0][4].tolist()  # a new entry
  with pytest.raises(ValueError, match="cannot compact"):
    eng.compact(state, [0, 1, 2, 3, 4])
  with pytest.raises(ValueError, match="cannot compact"):
    eng.compact(state, [0, 1, 2], size=2)
  with pytest.raises(ValueError, match="distinct"):
    eng.compact(state, [1, 1])
  with pytest.raises(ValueError, match="expand slots"):
    eng.expand(state, eng.compact(state, [0]), [8])
  with pytest.raises(ValueError, match="compact_sizes"):
    Engine(CFG, mesh, max_concurrent_decodes=4, max_prefill_length=8, max_decode_length=8,
           compact_sizes=(4,))


def test_prefill_ahead_batches_queued_prompts_with_the_same_samples(params, mesh):
  """A free slot's prefill takes the next queued prompts along (up to prefill_ahead), so later
  slots start from prefixes already computed; the samples are the ones one-at-a-time prefills
  give."""
  eng = engine(mesh, slots=4)
  ps = [p[:8] for p in prompts(8, seed=13)]  # one bucket
  reqs = lambda: [Request(i, p, max_new_tokens=2 + i % 3) for i, p in enumerate(ps)]
  got = {}
  for ahead in (0, None):
    calls = []
    orig = eng.prefill_many
    eng.prefill_many = lambda p, tokens, n: calls.append(len(tokens)) or orig(p, tokens, n)
    try:
      loop = GeneratorLoop(eng, params, prefill_ahead=ahead, sampling=eng.sampling)
      got[ahead] = run(loop, reqs())
    finally:
      del eng.prefill_many
    assert sum(calls) == 8, calls          # every prompt prefilled exactly once
    if ahead is None:
      assert loop.prefill_ahead == 4 and calls == [4, 4]
    else:
      assert max(calls[1:]) <= 2           # refills prefill only what the free slots need
  for k in got[0]:
    assert got[None][k].tokens == got[0][k].tokens
    np.testing.assert_allclose(got[None][k].logprobs, got[0][k].logprobs, atol=1e-5)


def test_attention_windows_give_the_dense_samples_without_recompiling(params, mesh):
  """With attention windows a step reads only the first W cache positions, W the smallest window
  holding every active slot (prompt + tokens so far). Greedy or sampled, with drain compaction,
  every sample and log-prob is the dense step's; each window is compiled once, by precompile."""
  from magistral_jax.generate.shapes import default_windows
  assert default_windows(288, 3) == (80, 144, 288)
  assert default_windows(2048, 4) == (256, 512, 1024, 2048)
  assert default_windows(32, 1) == (32,) and default_windows(32, 4) == (16, 32)
  with pytest.raises(ValueError, match=">= 1"):
    default_windows(32, 0)
  with pytest.raises(ValueError, match="must lie in"):
    Engine(CFG, mesh, max_concurrent_decodes=2, max_prefill_length=16, max_decode_length=16,
           attention_windows=(8, 40))
  ps = prompts(9, seed=5)
  reqs = lambda: [Request(i, p, max_new_tokens=2 + (5 * i) % 15, seed=i)
                  for i, p in enumerate(ps)]
  windows = (10, 14, 20, 26)
  for sampling in (GREEDY, SAMPLED):
    dense = run(GeneratorLoop(engine(mesh, slots=8, sampling=sampling), params,
                              sampling=sampling), reqs())
    eng = engine(mesh, slots=8, sampling=sampling, attention_windows=windows)
    assert eng.attention_windows == windows + (32,)
    assert eng.compact_engine(4).attention_windows == eng.attention_windows
    eng.precompile(eng.load_params(params), tune=False)
    compiled = eng.compile_counts()
    assert compiled["generate"] == 5
    loop = GeneratorLoop(eng, params, sampling=eng.sampling)
    got = run(loop, reqs())
    assert eng.compile_counts() == compiled
    assert got.keys() == dense.keys()
    for k in dense:
      assert got[k].tokens == dense[k].tokens, (sampling, k)
      np.testing.assert_allclose(got[k].logprobs, dense[k].logprobs, atol=1e-5)
    m = loop.metrics()
    assert loop.counters.compact_steps > 0 and 0.3 < m["attention_window_fraction"] < 1.0
  assert eng.window_for(1) == 10 and eng.window_for(21) == 26 and eng.window_for(32) == 32
  # The window does cut attention: a slot holding 13 prompt tokens, stepped with window 10
  # (too small for it), gets other logits than with the whole cache or a window that fits.
  lp = eng.load_params(params)
  padded, n, _ = eng.pad_prompt((ps[0] + ps[1])[:15])
  assert n > 10
  pre = eng.prefill(lp, padded, n, temperature=sampling.temperature)
  out = {w: eng.generate(lp, eng.insert(pre, eng.init_decode_state(), 0), w)[1]
         for w in (10, eng.window_for(n + 1), 32)}
  lps = {w: float(r.logprobs[0]) for w, r in out.items()}
  assert lps[eng.window_for(n + 1)] == pytest.approx(lps[32], abs=1e-5)
  assert abs(lps[10] - lps[32]) > 1e-4 or int(out[10].tokens[0]) != int(out[32].tokens[0])
  with pytest.raises(ValueError, match="33 positions exceed the cache length, 32"):
    eng.window_for(33)
  with pytest.raises(ValueError, match="17 tokens exceed the largest bucket, 16"):
    eng.bucket_for(17)
  with pytest.raises(ValueError, match="not one of"):
    eng.generate(eng.load_params(params), eng.init_decode_state(), 12)


def _by_thread(eng, calls):
  """Wraps eng.prefill_many to record which thread called it (undo with `del eng.prefill_many`)."""
  orig = eng.prefill_many
  def wrapped(*a):
    calls.append(threading.current_thread().name)
    return orig(*a)
  eng.prefill_many = wrapped


def test_background_prefill_gives_the_same_samples(params, mesh):
  # 30 requests (1-3 samples each, prompts in both buckets) through 4 slots: a worker thread
  # prefills the queue while the loop decodes; every sample equals the loop-thread prefill's.
  ps = prompts(30, seed=5)
  reqs = lambda: [Request(i, p, group_size=1 + i % 3, max_new_tokens=2 + i % 12, seed=i)
                  for i, p in enumerate(ps)]
  for sampling in (GREEDY, SAMPLED):
    eng = engine(mesh, sampling=sampling)
    sync = run(GeneratorLoop(eng, params, sampling=eng.sampling), reqs())
    # loop_prefill_below=0: the worker alone keeps the slots fed (see the next test for the loop's
    # own prefill when too few slots would decode).
    loop = GeneratorLoop(eng, params, options=opts(background_prefill=True, loop_prefill_below=0.0),
                         sampling=eng.sampling)
    calls = []
    _by_thread(eng, calls)
    try:
      bg = run(loop, reqs())
      # The same through the threaded loop (start / get / stop).
      threaded = GeneratorLoop(eng, params, options=opts(background_prefill=True,
                                                         loop_prefill_below=0.0),
                               sampling=eng.sampling).start()
      try:
        for r in reqs():
          threaded.submit(r)
        got = [threaded.get(timeout=120) for _ in range(sum(1 + i % 3 for i in range(30)))]
      finally:
        threaded.stop()
    finally:
      del eng.prefill_many
    assert bg.keys() == sync.keys() == {(c.request_id, c.sample_index) for c in got}
    for c in got:
      assert c.tokens == sync[c.request_id, c.sample_index].tokens
    for k in sync:
      assert bg[k].tokens == sync[k].tokens, (sampling, k)
      np.testing.assert_allclose(bg[k].logprobs, sync[k].logprobs, atol=1e-5)
      assert set(bg[k].versions.tolist()) == {0}
    m = loop.metrics()
    # The loop prefilled the first batch itself (nothing to decode yet), the worker the rest.
    assert calls[0] == "MainThread" and "generator-prefill" in calls
    assert 0 < m["background_prefilled"] < 30
    assert m["slot_utilization"] > 0.8
    for lp in (loop, threaded):  # the worker exits once the queue is empty
      w = lp.parts.prefiller.thread
      if w is not None:
        w.join(10)
      assert lp.parts.prefiller.thread is None


def test_loop_prefills_when_too_few_slots_would_decode(params, mesh):
  # With background prefill, a step never runs with fewer than loop_prefill_below of the slots
  # active while requests are queued: the loop fills the free slots with its own prefill instead
  # of decoding a near-empty batch while the worker catches up. Samples are unchanged.
  ps = prompts(24, seed=8)
  reqs = lambda: [Request(i, p, max_new_tokens=1 + i % 7) for i, p in enumerate(ps)]
  eng = engine(mesh)
  sync = run(GeneratorLoop(eng, params, sampling=eng.sampling), reqs())
  with pytest.raises(ValueError, match="loop_prefill_below"):
    opts(background_prefill=True, loop_prefill_below=1.5)
  for below, least in ((1.0, 4), (0.5, 2)):
    loop = GeneratorLoop(eng, params, options=opts(background_prefill=True,
                                                   loop_prefill_below=below), sampling=eng.sampling)
    seen = []
    orig = eng.generate
    def counted(*a):
      seen.append((int(loop.parts.slots.active.sum()), loop.parts.requests.qsize()))
      return orig(*a)
    eng.generate = counted
    try:
      out = run(loop, reqs())
    finally:
      del eng.generate
    assert out.keys() == sync.keys()
    for k in sync:
      assert out[k].tokens == sync[k].tokens, (below, k)
    queued = [a for a, q in seen if q > 0]
    assert queued and min(queued) >= least, (below, seen)


def test_background_prefill_under_weight_updates(params, mesh):
  # The worker prefills ahead under the weights current when it takes a request. Without
  # recompute a prompt prefilled under v0 keeps that cache after the swap (its first token is
  # tagged v0, as the paper keeps stale caches); with recompute it is prefilled again under v1.
  eng = engine(mesh)
  new = jax.tree.map(lambda x: x * 0.5, params)
  ps = prompts(12, seed=6)
  fresh = run(GeneratorLoop(eng, new, sampling=eng.sampling),
              [Request(i, p, max_new_tokens=8) for i, p in enumerate(ps)])
  for recompute in (False, True):
    loop = GeneratorLoop(eng, params, options=opts(background_prefill=True,
                                                   recompute_kv_on_update=recompute),
                         sampling=eng.sampling)
    for i, p in enumerate(ps):
      loop.submit(Request(i, p, max_new_tokens=8))
    for _ in range(3):
      loop.step()
    started = {s.group.request.id for s in loop.parts.slots.samples if s is not None}
    def waiting():  # prefilled under v0 (by the loop or the worker), not yet in a slot
      with loop._lock:
        gs = list(loop.parts.prefiller.ready) + list(loop.parts.groups)
      return {g.request.id for g in gs if g.prefix is not None} - started
    deadline = time.monotonic() + 30
    while (loop.parts.prefiller.in_flight or not waiting()) and time.monotonic() < deadline:
      time.sleep(0.01)
    waiting = waiting()
    assert len(started) == 4 and waiting
    loop.update_params(new, 1)
    out = {c.request_id: c for c in loop.run_until_idle()}
    assert sorted(out) == list(range(12))
    for i, c in out.items():
      v = c.versions.tolist()
      assert len(c.tokens) == 8 and v == sorted(v) and set(v) <= {0, 1}
      if i in started:
        assert v[:4] == [0] * 4 and v[4:] == [1] * 4
      elif i in waiting and not recompute:  # prefilled under v0, decoded under v1
        assert v == [0] + [1] * 7
      else:  # prefilled (again, with recompute) and decoded under v1
        assert v == [1] * 8 and c.tokens == fresh[i, 0].tokens, (recompute, i)


def test_background_prefill_failure_stops_the_loop_with_its_cause(params, mesh):
  eng = engine(mesh)
  loop = GeneratorLoop(eng, params, options=opts(background_prefill=True), sampling=eng.sampling)
  orig = eng.prefill_many
  def flaky(*a):
    if threading.current_thread().name == "generator-prefill":
      raise RuntimeError("prefill exploded")
    return orig(*a)
  eng.prefill_many = flaky
  try:
    for i, p in enumerate(prompts(12, seed=7)):
      loop.submit(Request(i, p, max_new_tokens=6))
    with pytest.raises(GeneratorError, match="background prefill failed(.|\n)*prefill exploded"):
      loop.run_until_idle()
  finally:
    del eng.prefill_many
  # Nothing is lost: the requests the worker held are kept, unprefilled, with the queued ones.
  assert loop.parts.prefiller.ready and all(g.prefix is None for g in loop.parts.prefiller.ready)
  ids = ({g.request.id for g in loop.parts.prefiller.ready}
         | {g.request.id for g in loop.parts.groups}
         | {g.request.id for g in loop.parts.requests.queue}
         | {s.group.request.id for s in loop.parts.slots.samples if s is not None}
         | {c.request_id for c in loop.completions.queue})
  assert ids == set(range(12))


SHARED = [7, 3, 99, 42, 5]   # a "system prompt" the shared-prefix tests' prompts start with


def shared_prompts(n, seed=0):
  rs = np.random.RandomState(seed)
  return [SHARED + rs.randint(1, CFG.vocab_size, rs.randint(1, 12)).tolist() for _ in range(n)]


def test_prefill_continuing_an_existing_prefix_equals_the_whole_prompt(params, mesh):
  """JetStream's existing_prefix: a prompt prefilled as the continuation of a cached prefix gives
  the whole prompt's cache, first token (the same slot stream), log-prob and continuation."""
  eng = engine(mesh, sampling=SAMPLED)
  p = eng.load_params(params)
  pad_shared, n_shared, _ = eng.pad_prompt(SHARED)
  prefix = eng.prefill(p, pad_shared, n_shared, temperature=SAMPLED.temperature)
  ps = shared_prompts(3, seed=20)
  whole = eng.init_decode_state()
  cont = eng.init_decode_state()
  for i, prompt in enumerate(ps):
    key = jax.random.PRNGKey(30 + i)
    pad, n, _ = eng.pad_prompt(prompt)
    a = eng.prefill(p, pad, n, temperature=SAMPLED.temperature, rng=key)
    rest, m, _ = eng.pad_prompt(prompt[n_shared:])
    b = eng.prefill(p, rest, m, temperature=SAMPLED.temperature, rng=key,
                    existing_prefix=prefix)
    assert int(b.true_length) == int(a.true_length) == len(prompt)
    assert int(b.token) == int(a.token)
    np.testing.assert_allclose(float(b.logprob), float(a.logprob), atol=1e-5)
    np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), atol=1e-4)
    for x, y in zip(a.cache.k + a.cache.v, b.cache.k + b.cache.v):  # the real positions agree
      ax = 3 if x.shape[-1] != CFG.head_dim else 2
      np.testing.assert_allclose(np.take(np.asarray(x), range(len(prompt)), ax),
                                 np.take(np.asarray(y), range(len(prompt)), ax), atol=1e-4)
    whole = eng.insert(a, whole, i)
    cont = eng.insert(b, cont, i)
  for _ in range(4):
    whole, r1 = eng.generate(p, whole)
    cont, r2 = eng.generate(p, cont)
    np.testing.assert_array_equal(np.asarray(r1.tokens), np.asarray(r2.tokens))
    np.testing.assert_allclose(np.asarray(r1.logprobs), np.asarray(r2.logprobs), atol=1e-5)
  # The batched form: the rows continue the one prefix.
  rests = np.zeros((2, 16), np.int32)
  for i, prompt in enumerate(ps[:2]):
    rests[i, :len(prompt) - n_shared] = prompt[n_shared:]
  many = eng.prefill_many(p, rests, [len(x) - n_shared for x in ps[:2]], existing_prefix=prefix)
  full = np.zeros((2, 16), np.int32)
  for i, prompt in enumerate(ps[:2]):
    full[i, :len(prompt)] = prompt
  ref = eng.prefill_many(p, full, [len(x) for x in ps[:2]])
  np.testing.assert_array_equal(np.asarray(many.true_length), np.asarray(ref.true_length))
  np.testing.assert_allclose(np.asarray(many.logits), np.asarray(ref.logits), atol=1e-4)
  # Bad input: too long together, a batch of prefixes, not a prefix at all.
  with pytest.raises(ValueError, match="exceeds max_prefill_length"):
    eng.prefill(p, np.ones(16, np.int32), 12, temperature=1.0, existing_prefix=prefix)
  with pytest.raises(ValueError, match="one prompt"):
    eng.prefill_many(p, rests, [2, 2], existing_prefix=many)
  with pytest.raises(TypeError, match="Prefix"):
    eng.prefill(p, rest, 1, temperature=1.0, existing_prefix=prefix.cache)


@pytest.mark.parametrize("sampling,background", [(GREEDY, False), (SAMPLED, True)])
def test_shared_prefix_loop_gives_the_same_samples_and_skips_its_prefill(params, mesh, sampling,
                                                                         background):
  eng = engine(mesh, sampling=sampling)
  ps = shared_prompts(6, seed=21)
  ps += [[9] + SHARED + [1, 2], list(SHARED)]   # does not start with it; is only the prefix
  reqs = lambda: [Request(i, x, group_size=2 if i % 3 == 0 else 1, max_new_tokens=3 + i % 5,
                          seed=i) for i, x in enumerate(ps)]
  ref = run(GeneratorLoop(eng, params, options=opts(background_prefill=background),
                          sampling=eng.sampling), reqs())
  loop = GeneratorLoop(eng, params, options=opts(background_prefill=background),
                       shared_prefix=SHARED, sampling=eng.sampling)
  out = run(loop, reqs())
  assert out.keys() == ref.keys()
  for k in ref:
    assert out[k].tokens == ref[k].tokens, k
    np.testing.assert_allclose(out[k].logprobs, ref[k].logprobs, atol=1e-5)
    assert out[k].prompt_tokens == ps[k[0]]
    if sampling is SAMPLED:   # still π_old as the trainer recomputes it over the whole sequence
      _, lp = score(params, ps[k[0]] + out[k].tokens)
      np.testing.assert_allclose(out[k].logprobs, lp[len(ps[k[0]]) - 1:], rtol=0, atol=2e-5)
  m = loop.metrics()
  assert m["shared_prefix_hits"] == 6   # the last two prompts are prefilled whole
  assert m["shared_prefix_tokens_skipped"] == 6 * len(SHARED)


def test_common_prefix_and_when_it_is_worth_caching():
  from magistral_jax.generate.prefix_cache import (SHARED_PREFIX_MIN_TOKENS, common_prefix,
                                                   useful_shared_prefix)
  assert common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == [1, 2]
  assert common_prefix([[1, 2], [1, 2, 3]]) == [1, 2] and common_prefix([[4, 5]]) == [4, 5]
  assert common_prefix([]) == [] and common_prefix([[1], [2]]) == []
  long = list(range(SHARED_PREFIX_MIN_TOKENS))
  assert useful_shared_prefix(long, 64) == long
  assert useful_shared_prefix(long[:-1], 64) is None             # too short to pay
  assert useful_shared_prefix(long, SHARED_PREFIX_MIN_TOKENS) is None   # no room left


def test_shared_prefix_follows_weight_updates(params, mesh):
  # The prefix is prefilled again under new weights (by the first prefill after the swap that
  # needs it), so a prompt that starts after the swap continues the new weights' prefix, as a
  # fresh loop on them would.
  eng = engine(mesh)
  new = jax.tree.map(lambda x: x * 0.5, params)
  ps = shared_prompts(5, seed=22)
  reqs = lambda: [Request(i, x, max_new_tokens=6) for i, x in enumerate(ps)]
  fresh = run(GeneratorLoop(eng, new, sampling=eng.sampling), reqs())
  loop = GeneratorLoop(eng, params, shared_prefix=SHARED, sampling=eng.sampling)
  # Every program compiled first (the compactions a drain may pick, by precompile; the shared
  # prefix's continuations, by a whole run under v0), whichever tests ran before this one.
  eng.precompile(eng.load_params(params), tune=False)
  run(loop, reqs())
  compiled = eng.compile_counts()
  loop.update_params(new, 1)
  out = run(loop, reqs())
  for k, c in out.items():
    assert c.tokens == fresh[k].tokens and set(c.versions.tolist()) == {1}
  assert eng.compile_counts() == compiled
  assert loop.metrics()["shared_prefix_prefills"] == 2   # once per weights version used
  with pytest.raises(ValueError, match="empty prompt"):
    GeneratorLoop(eng, params, shared_prefix=[], sampling=eng.sampling)
  with pytest.raises(ValueError, match="no room"):
    GeneratorLoop(eng, params, shared_prefix=list(range(1, 17)), sampling=eng.sampling)


def _overlap_run(eng, params, sampling, first, rest, steps_before_update, new_params, **kw):
  """Runs `first` for a few steps, updates the weights (version 1), then runs `rest` too; returns
  (samples by key, loop)."""
  loop = GeneratorLoop(eng, params, sampling=sampling, **kw)
  for r in first:
    loop.submit(r)
  for _ in range(steps_before_update):
    loop.step()
  loop.update_params(new_params, 1)
  return run(loop, rest), loop


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("compact", [False, True], ids=["dense", "compact"])
def test_overlap_host_gives_the_samples_of_the_synchronous_loop(params, mesh, sampling, compact):
  """With overlap_host the loop dispatches step n+1 before recording step n: a sample that
  finished at step n gets a wasted token at step n+1 (dropped) and its slot is refilled a step
  later. Samples (tokens, log-probs, policy versions) are those of the synchronous loop, over a
  mixed workload: different lengths, groups, EOS, a sample finishing on its first token, slot
  reuse, a weights update mid-run (before any slot is reused, so both loops switch at the same
  decode step of every sample), with and without drain compaction."""
  slots = 8 if compact else 4
  eng = engine(mesh, slots=slots, sampling=sampling)
  new = jax.tree.map(lambda x: x * 0.5, params)
  ps = prompts(12, seed=21)
  mk = lambda i, n, g=1: Request(i, ps[i], group_size=g, max_new_tokens=n, seed=100 + i)
  # An EOS that some samples hit mid-way: the most common token of a run without one.
  ref = run(GeneratorLoop(eng, params, sampling=eng.sampling), [mk(i, 12) for i in range(len(ps))])
  counts = collections.Counter(t for c in ref.values() for t in c.tokens[1:-1])
  eos = counts.most_common(1)[0][0]
  sc = dataclasses.replace(sampling, eos_id=eos, max_new_tokens=8)
  first = lambda: [mk(0, 14), mk(1, 10, 2), mk(2, 12)] + ([mk(3, 13, 4)] if compact else [])
  rest = lambda: [mk(4, 1), mk(5, 3, 3), mk(6, 16), mk(7, 5), mk(8, 9, 2), mk(9, 2), mk(10, 11),
                  Request(11, ps[11], seed=111)]
  out, loops = {}, {}
  for overlap in (False, True):
    out[overlap], loops[overlap] = _overlap_run(eng, params, sc, first(), rest(), 3, new,
                                                options=opts(overlap_host=overlap),
                                                compact_drain=compact)
  sync, ovl = out[False], out[True]
  assert sync.keys() == ovl.keys() and len(sync) == (19 if compact else 15)
  reasons = collections.Counter(c.finish_reason for c in sync.values())
  assert reasons["eos"] and reasons["length"], reasons
  assert any(len(c.tokens) == 1 for c in sync.values())
  for k, c in sync.items():
    o = ovl[k]
    assert o.tokens == c.tokens and o.finish_reason == c.finish_reason, k
    assert o.versions.tolist() == c.versions.tolist(), k
    np.testing.assert_allclose(o.logprobs, c.logprobs, atol=1e-5)
  versions = {v for c in sync.values() for v in c.versions.tolist()}
  assert versions == {0, 1}
  # Counters: the same tokens generated (every decode-step token; first tokens come with the
  # insert); the overlapped loop runs a few more steps (refills a step later).
  decoded = sum(len(c.tokens) - 1 for c in sync.values())
  for overlap, loop in loops.items():
    assert loop.counters.generated_tokens == loop.counters.active_slot_steps == decoded, overlap
    assert loop.counters.update_pause_steps == [0] and loop.version == 1
    assert loop.parts.ahead.step is None and loop.idle()
    if not compact:
      assert loop.counters.computed_slot_steps == slots * loop.counters.steps
      assert loop.counters.attended_positions == eng.cache_length * loop.counters.steps
    else:
      assert loop.counters.compact_steps > 0
  assert loops[True].counters.steps >= loops[False].counters.steps


def test_overlap_host_keeps_one_step_in_flight_and_records_it_when_asked(params, mesh):
  """step() leaves one decode step in flight (recorded by the next step); run_until_idle,
  a stopping loop thread and a step with nothing left to do record it, so no token is lost."""
  eng = engine(mesh)
  p = prompts(1, seed=22)[0]
  loop = GeneratorLoop(eng, params, compact_drain=False, sampling=eng.sampling)
  loop.submit(Request("x", p, max_new_tokens=10))
  loop.step()   # prefill + first token; decode step 1 dispatched, not recorded
  assert (loop.parts.ahead.step is not None and loop.counters.generated_tokens == 0
          and loop.counters.steps == 1)
  loop.step()   # step 2 dispatched, step 1 recorded
  assert loop.counters.generated_tokens == 1 and loop.counters.steps == 2
  loop.run_until_idle(max_steps=2)   # steps 3, 4; all four recorded on return
  assert loop.parts.ahead.step is None and loop.counters.generated_tokens == 4
  slot = next(i for i, s in enumerate(loop.parts.slots.samples) if s is not None)
  assert loop.parts.slots._count[slot] == 5   # the first token and four decode steps
  c = loop.run_until_idle()[0]
  alone = run(GeneratorLoop(eng, params, options=opts(overlap_host=False), sampling=eng.sampling),
              [Request("y", p, max_new_tokens=10)])["y", 0]
  assert c.tokens == alone.tokens and len(c.tokens) == 10
  # A refill while a step is in flight does not wait for the insert: the new sample's first
  # token is fetched and recorded with the next step's results.
  reqs = lambda: [Request(i, q, max_new_tokens=2 + i, seed=i)
                  for i, q in enumerate(prompts(5, seed=23))]
  r = GeneratorLoop(eng, params, compact_drain=False, sampling=eng.sampling)
  for q in reqs():
    r.submit(q)
  r.step()   # 4 slots filled (nothing in flight: first tokens fetched at once), step 1 dispatched
  r.step()   # step 2 dispatched; step 1 recorded: request 0 (2 tokens) finished
  assert r.completions.qsize() == 1 and not r.parts.ahead.step.firsts
  r.step()   # request 4 inserted into its slot, step 3 dispatched with its first token pending
  slot = next(i for i, s in enumerate(r.parts.slots.samples) if s and s.group.request.id == 4)
  assert [f[0].tolist() for f in r.parts.ahead.step.firsts] == [[slot]]
  assert r.parts.slots._count[slot] == 0
  got = {(c.request_id, c.sample_index): c for c in r.run_until_idle()}
  want = run(GeneratorLoop(eng, params, compact_drain=False, options=opts(overlap_host=False),
                           sampling=eng.sampling),
             reqs())
  assert got.keys() == want.keys()
  for k in want:
    assert got[k].tokens == want[k].tokens and got[k].versions.tolist() == [0] * len(got[k].tokens)
    np.testing.assert_allclose(got[k].logprobs, want[k].logprobs, atol=1e-5)
  # The thread: stop() records the step in flight before the thread ends.
  t = GeneratorLoop(eng, params, compact_drain=False, sampling=eng.sampling)
  t.submit(Request("t", p, max_new_tokens=16))
  t.start()
  deadline = time.monotonic() + 60
  while t.counters.generated_tokens < 3 and time.monotonic() < deadline:
    time.sleep(0.001)
  t.stop()
  assert t.parts.ahead.step is None
  assert t.counters.generated_tokens == t.counters.active_slot_steps
  # Every dispatched step is recorded: one token each while the sample runs (a step dispatched
  # after its last token, before that was known, is dropped).
  c = t.counters
  assert c.generated_tokens == c.steps if t.num_active else c.steps - 1 <= c.generated_tokens
  # NaN logits: raised by the step() that records the step showing them (the next one).
  bad = jax.device_put(T.to_decode_layout(jax.tree.map(lambda x: x * jnp.nan, params)),
                       eng.decode_param_shardings)
  n = GeneratorLoop(eng, params, compact_drain=False, sampling=eng.sampling)
  n.submit(Request("n", p, max_new_tokens=10))
  n.step()
  n.weights.params = bad
  n.step()   # dispatches the NaN step, records the good one
  with pytest.raises(NonFiniteError, match="non-finite logits in slots"):
    n.step()


def test_release_frees_weights_and_cache_and_reload_generates_like_a_fresh_loop(params, mesh):
  # The colocated schedule's turn-taking (pipeline.taking_turns): between generation phases the
  # loop holds no device memory; reloaded with new weights it samples what a fresh loop on them
  # samples, without recompiling.
  eng = engine(mesh, sampling=SAMPLED)
  new = jax.tree.map(lambda x: x * 0.5, params)
  ps = shared_prompts(4, seed=31)
  reqs = lambda: [Request(i, x, max_new_tokens=6, seed=100 + i) for i, x in enumerate(ps)]
  fresh = run(GeneratorLoop(eng, new, 3, shared_prefix=SHARED, sampling=eng.sampling), reqs())
  loop = GeneratorLoop(eng, params, shared_prefix=SHARED, sampling=eng.sampling)
  run(loop, reqs()[:2])
  compiled = eng.compile_counts()
  held = {id(x) for x in jax.tree.leaves((loop.state, loop.params))}
  loop.release()
  assert loop.released and loop.params is None
  assert not [a for a in jax.live_arrays() if id(a) in held]   # freed, not merely unreferenced
  with pytest.raises(RuntimeError, match="use update_params"):
    GeneratorLoop(eng, params, sampling=eng.sampling).reload(new, 1)
  with pytest.raises(ValueError, match="older"):
    loop.reload(new, -1)
  loop.reload(new, 3)
  out = run(loop, reqs())
  for k, c in out.items():
    assert c.tokens == fresh[k].tokens and set(c.versions.tolist()) == {3}
    np.testing.assert_allclose(c.logprobs, fresh[k].logprobs, rtol=1e-6)
  assert eng.compile_counts() == compiled
  loop.submit(reqs()[0])
  with pytest.raises(RuntimeError, match="still has work"):
    loop.release()


def test_a_loop_is_idle_once_its_last_sample_is_out(params, mesh):
  # The colocated sync phase steps the loop itself and ends as soon as its batch's last sample
  # is scored. The request's bookkeeping, still queued after its last sample went into a slot
  # (here all 4 slots: no free one to pop it), is no work: the loop is idle and can release.
  got = []
  loop = GeneratorLoop(engine(mesh, sampling=SAMPLED), params, callback=got.append,
                       sampling=SAMPLED)
  loop.submit(Request(0, prompts(1, seed=7)[0], group_size=4, max_new_tokens=4, seed=1))
  steps = 0
  while len(got) < 4:
    assert not loop.idle()
    loop.step()
    steps += 1
    assert steps < 50
  assert loop.idle()
  prefix = {id(x) for x in jax.tree.leaves(loop.parts.groups[0].prefix) if isinstance(x, jax.Array)}
  assert prefix
  loop.release()
  assert loop.released and not [a for a in jax.live_arrays() if id(a) in prefix]


def test_one_engine_samples_at_each_loops_temperature(params, mesh):
  """The temperature is an input of the engine's programs, carried per slot: loops at T = 0.7 and
  1.3 on one engine (built at 0.7) draw exactly what an engine built at each temperature draws,
  log-probs included, also when both loops' slots take turns on it; no program is compiled for
  the second temperature."""
  cold, hot = (SamplingConfig(temperature=t, top_p=0.9, top_k=20, max_new_tokens=8)
               for t in (0.7, 1.3))
  reqs = [Request(f"r{i}", p, group_size=2, max_new_tokens=8, seed=i)
          for i, p in enumerate(prompts(3, 9))]
  own = {name: run(GeneratorLoop(engine(mesh, sampling=sc), params, seed=1, sampling=sc), reqs)
         for name, sc in (("cold", cold), ("hot", hot))}
  shared = engine(mesh, sampling=cold)
  programs = lambda: (shared._prefill_many._cache_size(), shared._insert_many._cache_size(),
                      shared.generate_step.cache_size())
  run(GeneratorLoop(shared, params, seed=1, sampling=hot), reqs[:1])   # compile everything once
  before = programs()
  for name, sc in (("hot", hot), ("cold", cold), ("hot", hot)):
    got = run(GeneratorLoop(shared, params, seed=1, sampling=sc), reqs)
    assert got.keys() == own[name].keys()
    for k, c in got.items():
      assert c.tokens == own[name][k].tokens, (name, k)
      np.testing.assert_allclose(c.logprobs, own[name][k].logprobs, rtol=0, atol=1e-6)
  assert any(own["cold"][k].tokens != own["hot"][k].tokens for k in own["cold"])
  assert programs() == before
  with pytest.raises(ValueError, match="temperature must be > 0"):
    st = shared.init_decode_state()
    pre = shared.prefill_many(params, np.ones((1, 8), np.int32), np.ones((1,), np.int32))
    shared.insert_many(pre, st, [0], [0], np.zeros((1, 2), np.uint32), [0], np.ones(4, bool),
                       temperature=0.0)


def test_the_engine_contract_samples_at_the_requests_temperature(params, mesh):
  """prefill / insert / generate (the JetStream contract) sample at the temperature the request
  gives prefill, whatever temperature the engine's SamplingConfig was built with: an engine
  built for training (T = 1.0) serving an evaluation request (T = 0.7) draws exactly what an
  engine built at 0.7 draws, log-probs included, and every log-prob is log pi_0.7."""
  built = {t: engine(mesh, sampling=dataclasses.replace(SAMPLED, temperature=t))
           for t in (1.0, 0.7)}
  prompt = prompts(1, seed=31)[0]
  runs = {}
  for t, eng in built.items():
    p = eng.load_params(params)
    padded, n, _ = eng.pad_prompt(prompt)
    pre = eng.prefill(p, padded, n, temperature=0.7, rng=jax.random.PRNGKey(5))
    np.testing.assert_allclose(float(pre.logprob),
                               float(S.token_logprob(pre.logits, pre.token, 0.7)), atol=1e-6)
    state = eng.insert(pre, eng.init_decode_state(), 2)
    assert float(state.temperature[2]) == pytest.approx(0.7)
    toks, lps = [int(pre.token)], [float(pre.logprob)]
    for _ in range(4):
      state, r = eng.generate(p, state)
      toks.append(int(r.tokens[2]))
      lps.append(float(r.logprobs[2]))
    runs[t] = toks, lps
  assert runs[1.0][0] == runs[0.7][0]
  np.testing.assert_allclose(runs[1.0][1], runs[0.7][1], rtol=0, atol=1e-6)
  with pytest.raises(ValueError, match="prefill temperature must be > 0"):
    built[1.0].prefill(built[1.0].load_params(params), padded, n, temperature=0.0)


def test_insert_entries_are_checked_and_padded_to_one_program_shape():
  from magistral_jax.generate.shapes import pad_inserts
  slots, rows, keys, idx = pad_inserts([3, 0], [1, 1], [[1, 2], [3, 4]], [0, 5], n_slots=4,
                                       n_rows=2)
  np.testing.assert_array_equal(slots, [3, 0, 4, 4])   # padding: slot 4, out of range
  np.testing.assert_array_equal(rows, [1, 1, 0, 0])
  np.testing.assert_array_equal(keys, [[1, 2], [3, 4], [0, 0], [0, 0]])
  np.testing.assert_array_equal(idx, [0, 5, 0, 0])
  assert keys.dtype == np.uint32 and slots.dtype == rows.dtype == idx.dtype == np.int32
  with pytest.raises(ValueError, match="got 5 entries, want 1..4"):
    pad_inserts([0, 1, 2, 3, 0], [0] * 5, [[0, 0]] * 5, [0] * 5, n_slots=4, n_rows=2)
  with pytest.raises(ValueError, match="must be distinct"):
    pad_inserts([1, 1], [0, 0], [[0, 0]] * 2, [0, 1], n_slots=4, n_rows=2)
  with pytest.raises(ValueError, match=r"rows \[0, 2\] must be 2 indices in \[0, 2\)"):
    pad_inserts([0, 1], [0, 2], [[0, 0]] * 2, [0, 1], n_slots=4, n_rows=2)
