"""A live sequence continued with tokens the policy did not sample (issue #67: a tool's result):
Engine.extend keeps the slot's cache as it is and puts only the new tokens through the model,
on a per-slot and on a paged cache. Against a full prefill of the whole sequence, and, as the
negative control of "kept", against one under other weights: the kept positions hold the keys
and values of the weights that made them."""
import jax
import numpy as np
import pytest

from magistral_jax.generate.config import SamplingConfig
from magistral_jax.generate.engine import Engine
from magistral_jax.model import transformer as T
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import make_mesh

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
GREEDY = SamplingConfig(greedy=True, max_new_tokens=16)
SHAPE = dict(max_concurrent_decodes=4, max_prefill_length=16, max_decode_length=16,
             prefill_buckets=(8, 16))
PROMPT = [5, 17, 3, 99, 42]
RESULT = [7, 8, 9, 10]   # what the "tool" returned, as tokens


@pytest.fixture(scope="module")
def params():
  init = jax.jit(lambda k: jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x,
                                        T.init_params(CFG, k)))
  return init(jax.random.PRNGKey(0)), init(jax.random.PRNGKey(1))


@pytest.fixture(scope="module", params=["dense", "paged"])
def engine(request):
  mesh = make_mesh({"tensor": 2}, jax.devices()[:2])
  kw = dict(kv_pages=40, page_size=4) if request.param == "paged" else {}
  return Engine(CFG, mesh, sampling=GREEDY, **SHAPE, **kw)


def _start(eng, p, slot=2, steps=3):
  """PROMPT in `slot` (the others busy with other prompts), then `steps` decode steps: (state,
  the slot's sampled tokens; the last one pending, not yet in the cache)."""
  state = eng.init_decode_state()
  if eng.kv_pages is not None:   # every slot its own pages, in order
    per = eng.max_pages_per_slot
    table = 1 + np.arange(eng.max_concurrent_decodes * per).reshape(-1, per)
    state = eng.set_pages(state, table)
  for s in range(eng.max_concurrent_decodes):
    prompt = PROMPT if s == slot else [s + 1] * (3 + s)
    padded, n, _ = eng.pad_prompt(prompt)
    state = eng.insert(eng.prefill(p, padded, n, temperature=1.0), state, s)
  first = int(np.asarray(state.tokens)[slot])
  toks = [first]
  for _ in range(steps - 1):
    state, res = eng.generate(p, state)
    toks.append(int(np.asarray(res.tokens)[slot]))
  return state, toks


def _prefill(eng, p, seq, existing=None):
  padded, n, _ = eng.pad_prompt(seq)
  return eng.prefill(p, padded, n, temperature=1.0, existing_prefix=existing)


def test_extend_equals_a_prefill_of_the_whole_sequence(engine, params):
  p = engine.load_params(params[0])
  state, toks = _start(engine, p)
  length = len(PROMPT) + len(toks) - 1
  state, tok, lp = engine.extend(p, state, 2, [toks[-1]] + RESULT, length)
  ref = _prefill(engine, p, PROMPT + toks + RESULT)
  assert int(tok) == int(ref.token)
  np.testing.assert_allclose(float(lp), float(ref.logprob), atol=2e-5)
  assert int(np.asarray(state.cache.lengths)[2]) == length + 1 + len(RESULT)
  # The slot goes on decoding as the fresh prefill's slot would.
  other = engine.insert(ref, state, 3)
  for _ in range(4):
    other, res = engine.generate(p, other)
    got = np.asarray(res.tokens)
    assert got[2] == got[3]


def test_the_kept_positions_keep_the_weights_that_made_them(engine, params):
  """Negative control: extended under new weights, the slot's old positions keep the old
  weights' keys and values (a prefix cache made by the old weights, continued by the new, is the
  reference); a prefill of the whole sequence under the new weights differs."""
  old, new = map(engine.load_params, params)
  state, toks = _start(engine, old)
  length = len(PROMPT) + len(toks) - 1
  _, tok, lp = engine.extend(new, state, 2, [toks[-1]] + RESULT, length)
  kept = _prefill(engine, new, [toks[-1]] + RESULT, _prefill(engine, old, PROMPT + toks[:-1]))
  recomputed = _prefill(engine, new, PROMPT + toks + RESULT)
  np.testing.assert_allclose(float(lp), float(kept.logprob), atol=2e-5)
  assert int(tok) == int(kept.token)
  assert abs(float(lp) - float(recomputed.logprob)) > 1e-3


def test_extend_refuses_what_the_cache_cannot_hold(engine, params):
  p = engine.load_params(params[0])
  state, toks = _start(engine, p)
  with pytest.raises(ValueError, match="do not fit the cache"):
    engine.extend(p, state, 2, list(range(1, 16)), engine.cache_length - 4)


# ---- the loop: park, run, continue -------------------------------------------------------------
import threading   # noqa: E402

from magistral_jax.generate.loop import GeneratorLoop   # noqa: E402
from magistral_jax.generate.requests import Request   # noqa: E402
from magistral_jax.generate.tool_turns import ToolTurns   # noqa: E402
from magistral_jax.tool_use.config import ToolConfig   # noqa: E402
from magistral_jax.tool_use.protocol import result_block   # noqa: E402

LONG = SamplingConfig(greedy=True, max_new_tokens=60)
LOOP_SHAPE = dict(max_concurrent_decodes=4, max_prefill_length=96, max_decode_length=64,
                  prefill_buckets=(16, 32, 96))
CALL_AT = 3   # the test policy "writes a call" after this many tokens of its first turn


def tokenize(text):   # a byte-level tokenizer over the test model's 128 ids (ASCII)
  return [ord(c) for c in text]


def detokenize(tokens):
  return "".join(chr(int(t)) for t in tokens)


class CallAfter(ToolTurns):
  """The random test model writes no tags: its first turn "is" a call once it has CALL_AT tokens
  (the protocol's parsing is tests/tool_use/test_protocol.py); the call returns `output`."""

  def __init__(self, output="7", gate=None, **kw):
    def run(source):
      if gate is not None:
        gate.wait(30)
      return output, None
    super().__init__(ToolConfig(enabled=True, max_result_tokens=40, **kw), run, tokenize,
                     detokenize)

  def call_in(self, turn):
    return "print(7)" if len(turn) >= CALL_AT else None

  def maybe_call(self, slots, slot):   # the first turn of request "a" or "calls" only
    return (slots.results(slot) == 0 and slots.samples[slot].group.request.id in ("a", "calls")
            and super().maybe_call(slots, slot))


@pytest.fixture(scope="module", params=["dense", "paged"])
def loop_engine(request):
  mesh = make_mesh({"tensor": 2}, jax.devices()[:2])
  kw = dict(kv_pages=120, page_size=4) if request.param == "paged" else {}
  return Engine(CFG, mesh, sampling=LONG, **LOOP_SHAPE, **kw)


def _loop(eng, p, tools=None, **kw):
  return GeneratorLoop(eng, p, sampling=LONG, detokenize=detokenize, tools=tools, **kw)


def _one(eng, p, prompt, tools=None, max_new=30):
  loop = _loop(eng, p, tools)
  loop.submit(Request("a", prompt, max_new_tokens=max_new, seed=3))
  (s,) = loop.run_until_idle()
  return s, loop


@pytest.mark.parametrize("output", ["7", "8"])
def test_a_call_round_trips_and_the_sample_equals_a_prefill_of_its_whole_sequence(
    loop_engine, params, output):
  """The sample stops after CALL_AT tokens, the result's tokens go into its slot (marked as the
  tool's), and it goes on as a fresh prefill of prompt + its tokens so far would: the kept cache
  and the extension are exact. Negative control: another result, another continuation."""
  p = params[0]
  s, loop = _one(loop_engine, p, PROMPT, CallAfter(output))
  block = tokenize(result_block(output, 400))
  m = len(block)
  assert s.tokens[CALL_AT:CALL_AT + m] == block
  assert s.tool_mask.tolist() == [False] * CALL_AT + [True] * m + [False] * (
      len(s.tokens) - CALL_AT - m)
  assert len(s.tokens) == 30 and s.finish_reason == "length" and s.num_policy_tokens == 30 - m
  plain, _ = _one(loop_engine, p, PROMPT)
  assert s.tokens[:CALL_AT] == plain.tokens[:CALL_AT]
  # The whole sequence up to the result, prefilled fresh: the same continuation.
  head = CALL_AT + m
  ref, _ = _one(loop_engine, p, PROMPT + s.tokens[:head], max_new=30 - head)
  assert s.tokens[head:] == ref.tokens
  np.testing.assert_allclose(s.logprobs[head:], ref.logprobs, atol=2e-5)
  np.testing.assert_allclose(s.logprobs[:CALL_AT], plain.logprobs[:CALL_AT], atol=2e-5)
  assert loop.metrics()["tool_calls"] == 1 and loop.metrics()["tool_result_tokens"] == m
  if output == "8":   # the continuation read the result: another result, other log-probs
    other, _ = _one(loop_engine, p, PROMPT, CallAfter("7"))
    n = min(len(other.tokens), len(s.tokens))
    assert np.abs(other.logprobs[head:n] - s.logprobs[head:n]).max() > 1e-3


def test_other_slots_decode_while_one_waits_and_a_push_lands_meanwhile(loop_engine, params):
  """The call blocks until released: the other request runs to its end meanwhile, and weights
  pushed while the sample waits give its later tokens their version; its earlier ones, and the
  kept cache, stay those of version 0."""
  gate = threading.Event()
  tools = CallAfter(gate=gate)
  loop = _loop(loop_engine, params[0], tools)
  loop.submit(Request("calls", PROMPT, max_new_tokens=30, seed=3))
  loop.submit(Request("plain", [9, 9, 9], max_new_tokens=8, seed=4))
  done = []
  for _ in range(40):
    loop.step()
    while not loop.completions.empty():
      done.append(loop.completions.get())
  assert [d.request_id for d in done] == ["plain"] and tools.busy() and not loop.idle()
  loop.update_params(params[1], 1)
  gate.set()
  (s,) = loop.run_until_idle()
  m = int(s.tool_mask.sum())
  assert s.versions[:CALL_AT].tolist() == [0] * CALL_AT
  assert set(s.versions[CALL_AT + m:].tolist()) == {1}


def test_a_result_past_the_budget_ends_the_sample_and_limits_hold(loop_engine, params):
  # Room for CALL_AT tokens and a few more: the result does not fit, the sample ends there.
  s, loop = _one(loop_engine, params[0], PROMPT, CallAfter(), max_new=CALL_AT + 5)
  assert s.finish_reason == "length" and s.tool_mask is None and len(s.tokens) == CALL_AT
  assert loop.metrics()["tool_truncated"] == 1
  # An output longer than the result block's room is cut, the block closed.
  tools = CallAfter("x" * 200)
  tokens = tools.result_tokens("x" * 200)
  assert len(tokens) <= 40 and detokenize(tokens).endswith("\n</result>\n")
  assert detokenize(tokens).startswith("\n<result>\nxx")
  # max_calls=0: the call does not run; its result says why.
  s, _ = _one(loop_engine, params[0], PROMPT, CallAfter(max_calls=0), max_new=60)
  assert detokenize(np.asarray(s.tokens)[s.tool_mask]).startswith("\n<result>\nerror: no more")
