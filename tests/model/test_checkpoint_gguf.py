"""GGUF import on a tiny GGUF we write ourselves (fast, exact). The shipped SmolLM2-135M-Instruct
Q4_1 file against transformers' own GGUF import (tensors, config, tokenizer, chat template) is in
test_smollm2_parity.py, which loads both models once for all the real-model checks."""
import os
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest

from magistral_jax.model.config import UnsupportedArchitectureError
from magistral_jax.model.gguf_checkpoint import _GGUF_LAYER_NAMES, load_gguf
from magistral_jax.model.gguf_file import read_gguf
from magistral_jax.model.hf_checkpoint import load_hf_safetensors
from magistral_jax.model.hf_layout import CheckpointError, params_to_hf
from magistral_jax.model.orbax_params import read_orbax_config, restore_params_orbax

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

L, D, F, H, K, DH = 2, 32, 48, 4, 2, 8
_GGUF_NAMES = {v: k for k, v in _GGUF_LAYER_NAMES.items()}


def _byte_alphabet():
  """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet)."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  extra = [b for b in range(256) if b not in keep]
  return {b: chr(b) if b in keep else chr(256 + extra.index(b)) for b in range(256)}


def _tiny_vocab():
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  alphabet = _byte_alphabet()
  merges = ["Ġ t", "h e", "Ġt he", "i n"]
  tokens = specials + [alphabet[b] for b in range(256)] + ["Ġt", "he", "Ġthe", "in"]
  types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
  return tokens, types, merges


def _write_tiny_gguf(path, state, arch="llama", tie=False, drop=(), reshape=None):
  """Writes HF-named float32 `state` as a llama.cpp GGUF (q/k rows permuted as llama.cpp does)."""
  tokens, types, merges = _tiny_vocab()
  w = gguf.GGUFWriter(str(path), arch=arch)
  w.add_name("tiny test model")
  w.add_block_count(L)
  w.add_context_length(128)
  w.add_embedding_length(D)
  w.add_feed_forward_length(F)
  w.add_head_count(H)
  w.add_head_count_kv(K)
  w.add_rope_dimension_count(DH)
  w.add_rope_freq_base(50000.0)
  w.add_layer_norm_rms_eps(1e-6)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(merges)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                      "{% endif %}")
  for name, t in state.items():
    if name in drop:
      continue
    if name.endswith(("q_proj.weight", "k_proj.weight")):
      n = H if "q_proj" in name else K
      t = t.reshape(n, 2, t.shape[0] // n // 2, t.shape[1]).swapaxes(1, 2).reshape(t.shape)
    if reshape and name in reshape:
      t = np.zeros(reshape[name], np.float32)
    if name == "lm_head.weight":
      if tie:
        continue
      gname = "output.weight"
    elif name == "model.embed_tokens.weight":
      gname = "token_embd.weight"
    elif name == "model.norm.weight":
      gname = "output_norm.weight"
    else:
      i, suffix = name[len("model.layers."):].split(".", 1)
      gname = f"blk.{i}.{_GGUF_NAMES[suffix]}"
    w.add_tensor(gname, np.ascontiguousarray(t, dtype=np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def _tiny_state(tie=False):
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=len(_tiny_vocab()[0]), hidden_size=D,
                                 intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                                 num_key_value_heads=K, head_dim=DH, tie_word_embeddings=tie)
  model = transformers.LlamaForCausalLM(cfg)
  return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tie", [False, True])
def test_tiny_gguf_loads_back_the_exact_hf_tensors(tmp_path, tie):
  state = _tiny_state(tie)
  path = _write_tiny_gguf(tmp_path / "tiny.gguf", state, tie=tie)
  cfg, params, tok = load_gguf(path)
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (L, D, H, K, DH)
  assert cfg.rope_theta == 50000.0 and cfg.rms_norm_eps == pytest.approx(1e-6)
  assert cfg.tie_word_embeddings == tie and cfg.architecture == "LlamaForCausalLM"
  got = params_to_hf(params, cfg)
  want = {k: v for k, v in state.items() if not (tie and k == "lm_head.weight")}
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  # The tokenizer came from the same file.
  assert (tok.bos_id, tok.eos_id) == (1, 2)
  text = "the thin tether, ünïcode 中文"
  assert tok.decode(tok.encode(text)) == text
  assert tok.encode(" the")[0] == tok.tokenizer.token_to_id("Ġthe")


def test_gguf_with_unsupported_architecture_is_named(tmp_path):
  path = _write_tiny_gguf(tmp_path / "g.gguf", _tiny_state(), arch="gpt2")
  with pytest.raises(UnsupportedArchitectureError, match="'gpt2'"):
    load_gguf(path)


def test_gguf_wrong_shape_and_missing_tensor_are_named(tmp_path):
  path = _write_tiny_gguf(tmp_path / "g.gguf", _tiny_state(),
                          drop=("model.layers.1.mlp.down_proj.weight",),
                          reshape={"model.layers.0.mlp.up_proj.weight": (40, D)})
  with pytest.raises(CheckpointError) as e:
    load_gguf(path)
  msg = str(e.value)
  assert "model.layers.1.mlp.down_proj.weight" in msg
  assert "blk.0.ffn_up.weight" in msg and "(40, 32)" in msg and "(48, 32)" in msg


def test_header_parser_agrees_with_gguf_reader(tmp_path):
  path = _write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_state())
  ours, ref = read_gguf(path), gguf.GGUFReader(path)
  fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
  assert ours.metadata == fields
  raw = ours.tensors()
  assert sorted(raw) == sorted(t.name for t in ref.tensors)
  for t in ref.tensors:
    qtype, shape, data = raw[t.name]
    assert qtype == t.tensor_type and shape == tuple(reversed([int(x) for x in t.shape]))
    assert data.tobytes() == np.asarray(t.data).tobytes()


def test_truncated_gguf_is_named(tmp_path):
  path = _write_tiny_gguf(tmp_path / "cut.gguf", _tiny_state())
  data = open(path, "rb").read()
  open(path, "wb").write(data[: len(data) - 100])
  with pytest.raises(CheckpointError, match=r"cut\.gguf.*(truncated|past the end)"):
    load_gguf(path)


def test_not_a_gguf_file_is_named(tmp_path):
  path = tmp_path / "broken.gguf"
  path.write_bytes(b"GGUF" + b"\x00" * 7)
  with pytest.raises(CheckpointError, match="broken.gguf"):
    load_gguf(str(path))


# ---- launch/convert_checkpoint.py (run/convert.py) on GGUF input ---------------------------------
def test_convert_gguf_to_hf_writes_weights_config_and_tokenizer(tmp_path):
  from magistral_jax.run import convert as convert_checkpoint
  from magistral_jax.model.tokenizer import HFTokenizer
  path = _write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_state())
  convert_checkpoint.convert("gguf_to_hf", path, str(tmp_path / "hf"))
  cfg0, params0, tok0 = load_gguf(path)
  cfg, params = load_hf_safetensors(str(tmp_path / "hf"))
  assert cfg == cfg0
  for a, b in zip(jax.tree.leaves(params0), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  tok = HFTokenizer.from_file(str(tmp_path / "hf"))
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (tok0.bos_id, tok0.eos_id, tok0.pad_id)
  assert tok.apply_chat_template("the 中文") == tok0.apply_chat_template("the 中文")


def test_convert_cli_gguf_to_orbax(tmp_path):
  path = _write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_state())
  script = os.path.join(os.path.dirname(__file__), "..", "..", "launch", "convert_checkpoint.py")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, script, "--direction=gguf_to_orbax", f"--input={path}",
                        f"--output={tmp_path / 'orbax'}"], capture_output=True, text=True, env=env,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert '"direction": "gguf_to_orbax"' in out.stdout.strip().splitlines()[-1]
  cfg0, params0, _ = load_gguf(path, with_tokenizer=False)
  assert read_orbax_config(str(tmp_path / "orbax" / "params")) == cfg0
  restored = restore_params_orbax(str(tmp_path / "orbax" / "params"))
  for a, b in zip(jax.tree.leaves(params0), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(a, np.asarray(b))
  # A bad direction or input is refused before anything is written.
  bad = subprocess.run([sys.executable, script, "--direction=hf_to_orbax",
                        f"--input={tmp_path / 'missing'}", f"--output={tmp_path / 'never'}"],
                       capture_output=True, text=True, env=env, timeout=300)
  assert bad.returncode != 0 and "missing" in bad.stderr
  assert not os.path.exists(tmp_path / "never")

