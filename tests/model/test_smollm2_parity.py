"""The shipped SmolLM2-135M-Instruct GGUF file against transformers' own import of it: the import
(tensors, config, tokenizer, chat template), our decoder's logits and greedy tokens, and the
engine's greedy samples and log-probs. In one file so that each model loads once (module
fixtures): transformers' GGUF import is most of these tests' time.

Tolerance: both sides run fp32 on identical dequantized weights, so differences come only from
matmul accumulation order through 30 layers. Logits have magnitude ~10-30; we measured a max
|diff| of ~1e-4 and allow 2e-3 (≈1e-4 relative), far below anything that changes a greedy argmax
except for exact ties, and far above float32 reassociation noise accumulated over 30 layers.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magistral_jax.generate.config import SamplingConfig
from magistral_jax.generate.engine import Engine
from magistral_jax.generate.loop import GeneratorLoop
from magistral_jax.generate.requests import Request
from magistral_jax.model import config as model_config
from magistral_jax.model import transformer as T
from magistral_jax.model.gguf_checkpoint import load_gguf
from magistral_jax.model.gguf_file import default_gguf_path
from magistral_jax.model.hf_layout import params_to_hf
from magistral_jax.model.tokenizer import chat_messages
from magistral_jax.parallel.sharding import make_mesh

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["What is 12 + 35? Answer:", "The capital of France is",
           "def fibonacci(n):\n    "]
ENGINE_PROMPT = PROMPTS[1]
NEW_TOKENS = 32
LOGIT_TOL = 2e-3


@pytest.fixture(scope="module")
def smollm2():
  path = default_gguf_path()
  cfg, params, tok = load_gguf(path)
  return path, cfg, params, tok


@pytest.fixture(scope="module")
def device_params(smollm2):
  # On the device once: host (numpy) params would be copied to it on every call of a step.
  return jax.device_put(smollm2[2])


@pytest.fixture(scope="module")
def smollm2_hf(smollm2):
  path = smollm2[0]
  model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
  model.eval()
  hf_tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))
  return model, hf_tok


@pytest.fixture(scope="module")
def hf_greedy(smollm2, smollm2_hf):
  """transformers' greedy NEW_TOKENS tokens after a prompt, generated once per prompt: the decoder
  test and the engine test compare with the same reference."""
  tok, (model, _) = smollm2[3], smollm2_hf
  done = {}

  def greedy(prompt):
    if prompt not in done:
      ids = tok.encode(prompt)
      with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
      done[prompt] = out[0, len(ids):].tolist()
    return done[prompt]
  return greedy


# ---- the import ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_gguf_tensors_equal_transformers_import(smollm2, smollm2_hf):
  _, cfg, params, _ = smollm2
  model, _ = smollm2_hf
  hc = model.config
  assert type(model).__name__ == "LlamaForCausalLM" and cfg.architecture == "LlamaForCausalLM"
  assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
      hc.vocab_size, hc.hidden_size, hc.intermediate_size, hc.num_hidden_layers)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
      hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim)
  assert cfg.rope_theta == hc.rope_parameters["rope_theta"] and cfg.rms_norm_eps == hc.rms_norm_eps
  assert cfg.tie_word_embeddings == hc.tie_word_embeddings is True
  assert (cfg.bos_token_id, cfg.eos_token_id) == (hc.bos_token_id, hc.eos_token_id)
  # The random-init preset the benchmarks use has the file's shapes.
  preset = model_config.SMOLLM2_135M
  assert preset == cfg.replace(rms_norm_eps=preset.rms_norm_eps)  # the file holds it in float32
  ours = params_to_hf(params, cfg)
  theirs = {k: v.numpy() for k, v in model.state_dict().items()}
  assert sorted(theirs) == sorted(list(ours) + ["lm_head.weight"])  # theirs: the tied alias
  for k in ours:
    np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)


_TEXTS = ["Hello world!", "  leading spaces\tand tabs\n\nnew lines", "Ünïcödé façade — naïve",
          "中文数学题：求 x 的值。", r"$\int_0^1 x^2\,dx = \frac{1}{3}$ and \boxed{42}",
          "12345 + 678 = 13023", "def f(x):\n    return x ** 2  # 🙂", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_matches_transformers(smollm2, smollm2_hf):
  tok, (_, hf_tok) = smollm2[3], smollm2_hf
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id,
                                                  hf_tok.pad_token_id)
  for text in _TEXTS:
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_digits_are_split_before_byte_level_as_in_llama_cpp(smollm2):
  # GGUF pre-tokenizer 'smollm': llama.cpp splits digits off first, so "  15" keeps its two spaces
  # in one token. (transformers' GGUF converter ignores 'smollm' and gives 'Ġ', 'Ġ' here; the
  # original SmolLM2 tokenizer.json has Digits(individual_digits) before ByteLevel, like us.)
  tok = smollm2[3]
  pieces = [tok.tokenizer.id_to_token(i) for i in tok.encode("It turns  15 times")]
  assert pieces[-4:] == ["ĠĠ", "1", "5", "Ġtimes"]


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2, smollm2_hf):
  tok, (_, hf_tok) = smollm2[3], smollm2_hf
  problem = "Find $x$ such that $2x + 3 = 7$."
  want = hf_tok.apply_chat_template(chat_messages(problem), add_generation_prompt=True,
                                    tokenize=True, return_dict=False)
  ids = tok.apply_chat_template(problem)
  assert ids == list(want)
  text = tok.decode(ids, skip_special_tokens=False)
  assert text.startswith("<|im_start|>system\nA user will ask you to solve a task.")
  assert text.endswith("Problem:<|im_end|>\n<|im_start|>user\n" + problem +
                       "<|im_end|>\n<|im_start|>assistant\n")


# ---- our decoder ---------------------------------------------------------------------------------
def _greedy_ours(step, params, cfg, ids, n, max_len=64):
  # One cache length and one jitted step for every prompt: the one-token step compiles once.
  assert len(ids) + n <= max_len
  cache = T.init_cache(cfg, 1, max_len)
  lg, cache = step(params, jnp.asarray([ids]), cache)
  out = []
  for _ in range(n):
    nxt = int(jnp.argmax(lg[0, -1]))
    out.append(nxt)
    lg, cache = step(params, jnp.asarray([[nxt]]), cache)
  return out


def test_smollm2_logits_match_transformers(smollm2, device_params, smollm2_hf):
  _, cfg, _, tok = smollm2
  hf = smollm2_hf[0]
  fwd = jax.jit(lambda p, t: T.forward_logits(p, cfg, t))
  for prompt in PROMPTS:
    ids = tok.encode(prompt)
    ours = np.asarray(fwd(device_params, jnp.asarray([ids])))
    with torch.no_grad():
      ref = hf(torch.tensor([ids])).logits.numpy()
    assert np.max(np.abs(ours - ref)) < LOGIT_TOL, prompt


def test_smollm2_greedy_32_tokens_identical_to_transformers(smollm2, device_params, hf_greedy):
  _, cfg, _, tok = smollm2
  step = jax.jit(lambda p, t, c: T.decode_logits(p, cfg, t, c))
  for prompt in PROMPTS:
    got = _greedy_ours(step, device_params, cfg, tok.encode(prompt), NEW_TOKENS)
    assert got == hf_greedy(prompt), prompt


# ---- the engine ---------------------------------------------------------------------------------
def test_engine_greedy_32_tokens_identical_to_transformers_with_exact_logprobs(
    smollm2, device_params, hf_greedy):
  """Lean (one prompt, one engine, one slot): the decoder test above covers the other prompts."""
  _, cfg, params, tok = smollm2
  ids = tok.encode(ENGINE_PROMPT)
  eng = Engine(cfg, make_mesh({"tensor": 1}, jax.devices()[:1]), max_concurrent_decodes=1,
               max_prefill_length=16, max_decode_length=NEW_TOKENS, prefill_buckets=(16,),
               sampling=SamplingConfig(greedy=True, max_new_tokens=NEW_TOKENS))
  loop = GeneratorLoop(eng, params, sampling=eng.sampling)
  loop.submit(Request("p", ids))
  (c,) = loop.run_until_idle()
  assert c.tokens == hf_greedy(ENGINE_PROMPT)

  # π_old from the engine is the trainer's π_θ recomputed by the scoring forward.
  seq = jnp.asarray([ids + c.tokens])
  lp = jax.jit(lambda p, s: T.token_logprobs(p, cfg, T.hidden_states(p, cfg, s)[:, :-1],
                                             s[:, 1:]))(device_params, seq)
  np.testing.assert_allclose(c.logprobs, np.asarray(lp[0, len(ids) - 1:]), rtol=0, atol=1e-4)
