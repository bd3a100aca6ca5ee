"""Tokenizers: encode/decode round trips and the Magistral chat prompt, for each backend.

The SmolLM2 GGUF tokenizer is compared with transformers' in test_smollm2_parity.py.
"""
import json
import sys

import pytest

from magistral_jax.model import tokenizer as tk

TEXTS = [
    "Hello world!",
    "  two leading spaces,\ttabs\n\nand blank lines\n",
    "Ünïcödé façade — naïve café, Ελληνικά, русский",
    "中文数学题：求 x 的值。日本語のテキスト",
    r"$\int_0^1 x^2\,dx = \frac{1}{3}$, $\sqrt{2} \approx 1.414$ so \boxed{42}",
    "def f(x):\n    return x ** 2  # 🙂🚀",
    "12345678901234567890",
]


def _chatml_template():
  return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_level_meta():
  """GGUF-style metadata for a small byte-level BPE vocabulary (every byte + a few merges)."""
  keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
  extra = [b for b in range(256) if b not in keep]
  alphabet = [chr(b) if b in keep else chr(256 + extra.index(b)) for b in range(256)]
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  tokens = specials + alphabet + ["Ġt", "he", "Ġthe", "Ġ1"]
  return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
          "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": [3] * 3 + [1] * (len(tokens) - 3),
          "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he", "Ġ 1"]}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tokenizer.json + tokenizer_config.json directory (what an HF checkpoint ships)."""
  d = tmp_path_factory.mktemp("hf_tok")
  tk.tokenizer_from_gguf_metadata(_byte_level_meta()).save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
      "pad_token": "<|endoftext|>", "chat_template": _chatml_template()}))
  return str(d)


@pytest.fixture(scope="module", params=["tekken", "sentencepiece", "hf"])
def tokenizer(request, hf_dir):
  if request.param == "tekken":
    return tk.MistralCommonTokenizer("tekken_240911.json")
  if request.param == "sentencepiece":
    pytest.importorskip("sentencepiece")
    return tk.MistralCommonTokenizer("mistral_instruct_tokenizer_241114.model.v7")
  return tk.HFTokenizer.from_file(hf_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tokenizer, text):
  ids = tokenizer.encode(text)
  assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
  assert tokenizer.decode(ids) == text


def test_bos_and_special_ids(tokenizer):
  ids = tokenizer.encode("x", add_bos=True)
  assert ids[0] == tokenizer.bos_id and ids[1:] == tokenizer.encode("x")
  assert tokenizer.eos_id != tokenizer.bos_id
  assert 0 <= tokenizer.pad_id < tokenizer.vocab_size
  # Special tokens disappear from decoded text by default (completions end in EOS).
  assert tokenizer.decode(tokenizer.encode("ok") + [tokenizer.eos_id]) == "ok"
  assert isinstance(tokenizer, tk.Tokenizer)


def test_chat_template_ends_at_the_assistant_turn(tokenizer):
  problem = "Find all real $x$ with $x^2 = 4$. 你好"
  ids = tokenizer.apply_chat_template(problem)
  text = tokenizer.decode(ids, skip_special_tokens=False)
  system = tk.MAGISTRAL_SYSTEM_PROMPT.partition("{problem}")[0].rstrip()
  if isinstance(tokenizer, tk.MistralCommonTokenizer) and tokenizer.path.endswith("json"):
    # Tekken V3: the system prompt joins the user turn, so "Problem:\n\n" sits above the problem.
    assert ids[0] == tokenizer.bos_id
    assert text == f"<s>[INST]{system}\n\n{problem}[/INST]"
  elif isinstance(tokenizer, tk.MistralCommonTokenizer):
    # SentencePiece V7 has its own system turn; pieces decode with "▁", so compare ids.
    special = tokenizer._tok.get_special_token
    assert ids == ([tokenizer.bos_id, special("[SYSTEM_PROMPT]")] + tokenizer.encode(system)
                   + [special("[/SYSTEM_PROMPT]"), special("[INST]")] + tokenizer.encode(problem)
                   + [special("[/INST]")])
  else:
    assert text == (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{problem}"
                    "<|im_end|>\n<|im_start|>assistant\n")
  # Without a system prompt only the user turn remains.
  bare = tokenizer.decode(tokenizer.apply_chat_template(problem, system_prompt=None))
  assert "A user will ask you" not in bare and problem in bare
  assert problem in tokenizer.decode(ids) and "Problem:" in tokenizer.decode(ids)


def test_system_prompt_is_the_papers():
  p = tk.MAGISTRAL_SYSTEM_PROMPT
  assert p.startswith("A user will ask you to solve a task. You should first draft your thinking")
  assert "Be as casual and as long as you want until you are confident" in p
  assert "<think>\nYour thoughts or/and draft" in p and "\n</think>\n\nHere, provide" in p
  assert p.endswith("to the user.\n\nProblem:\n\n{problem}")


def test_problem_goes_in_the_user_turn():
  msgs = tk.chat_messages("What is 2+2?")
  assert [m["role"] for m in msgs] == ["system", "user"]
  assert msgs[0]["content"].endswith("final answer to the user.\n\nProblem:")
  assert msgs[1]["content"] == "What is 2+2?"
  # Text after the placeholder follows the problem; no placeholder: the prompt is all system.
  assert tk.chat_messages("Q", "Solve:\n{problem}\nThink.")[1]["content"] == "Q\nThink."
  assert tk.chat_messages("Q", "Be brief.") == [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Q"}]
  assert tk.chat_messages("Q", None) == [{"role": "user", "content": "Q"}]


def test_chatml_renders_the_same_without_jinja2(hf_dir, monkeypatch):
  tok = tk.HFTokenizer.from_file(hf_dir)
  with_jinja = tok.apply_chat_template("2+2?")
  monkeypatch.setitem(sys.modules, "jinja2", None)
  monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
  assert tok.apply_chat_template("2+2?") == with_jinja


def test_digits_are_split_one_by_one_for_smollm_vocabularies(hf_dir):
  # llama.cpp's 'smollm' pre-tokenizer (and SmolLM2's tokenizer.json) isolates every digit, so a
  # merge of space + digit ("Ġ1") never applies; GPT-2's plain pre-tokenizer would use it.
  tok = tk.HFTokenizer.from_file(hf_dir)
  g1 = tok.tokenizer.token_to_id("Ġ1")
  assert g1 not in tok.encode(" 1 11 x1") and tok.decode(tok.encode(" 1 11 x1")) == " 1 11 x1"
  plain = tk.tokenizer_from_gguf_metadata(dict(_byte_level_meta(), **{"tokenizer.ggml.pre": "default"}))
  assert plain.encode(" 1", add_special_tokens=False).ids == [g1]


def test_unknown_inputs_get_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="tekken_240911.json"):
    tk.MistralCommonTokenizer("no_such_tokenizer.json")
  with pytest.raises(ValueError, match="'bpe-of-the-future'"):
    tk.tokenizer_from_gguf_metadata(dict(_byte_level_meta(), **{"tokenizer.ggml.pre": "bpe-of-the-future"}))
  with pytest.raises(ValueError, match="'llama'"):
    tk.tokenizer_from_gguf_metadata(dict(_byte_level_meta(), **{"tokenizer.ggml.model": "llama"}))
  bad = tmp_path / "tokenizer.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="tokenizer.json"):
    tk.HFTokenizer.from_file(str(bad))


def test_load_tokenizer_dispatch(hf_dir):
  assert isinstance(tk.load_tokenizer("mistral:tekken_240911.json"), tk.MistralCommonTokenizer)
  assert isinstance(tk.load_tokenizer(hf_dir), tk.HFTokenizer)
  assert tk.load_tokenizer("mistral:tekken_240911.json").vocab_size == 131072


def test_shared_prompt_prefix_starts_every_rendered_prompt(tokenizer):
  """pipeline.generators.shared_prompt_prefix: the token prefix the engine prefills once per
  weights version (GeneratorLoop shared_prefix) is the system prompt's, and every prompt starts
  with it."""
  import dataclasses
  from magistral_jax.generate.config import EngineConfig
  from magistral_jax.generate.prefix_cache import SHARED_PREFIX_MIN_TOKENS
  from magistral_jax.pipeline import generators as build
  prefix = build.shared_prompt_prefix(tokenizer, tk.MAGISTRAL_SYSTEM_PROMPT)
  # Most of the system prompt's tokens (the template head too), but not the problem's.
  assert len(prefix) >= 0.9 * len(tokenizer.encode(tk.MAGISTRAL_SYSTEM_PROMPT.split("{problem}")[0]))
  for text in TEXTS + ["What is 2+3?", " 7", "(a) Soit $x$ un réel."]:
    assert tokenizer.apply_chat_template(text, tk.MAGISTRAL_SYSTEM_PROMPT)[:len(prefix)] == prefix
  engine = EngineConfig(shared_prefix_cache=True, max_prefill_length=4096)
  assert build.shared_prefix_for(engine, tokenizer, tk.MAGISTRAL_SYSTEM_PROMPT) == prefix
  short = dataclasses.replace(engine, max_prefill_length=len(prefix))   # no room for a problem
  assert build.shared_prefix_for(short, tokenizer, tk.MAGISTRAL_SYSTEM_PROMPT) is None
  off = dataclasses.replace(engine, shared_prefix_cache=False)
  assert build.shared_prefix_for(off, tokenizer, tk.MAGISTRAL_SYSTEM_PROMPT) is None
  # Without a system prompt only the template's head is shared: too short to be worth it.
  assert len(build.shared_prompt_prefix(tokenizer, None)) < SHARED_PREFIX_MIN_TOKENS
  assert build.shared_prefix_for(engine, tokenizer, None) is None
