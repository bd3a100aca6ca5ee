"""A character-level tokenizer for the tiny synthetic-arithmetic task (configs/tiny.py).

It is a real `tokenizers.Tokenizer` (WordLevel over single characters, with "<think>", "</think>"
and "\\boxed{" as whole tokens), wrapped in our HFTokenizer interface: same encode/decode/chat
template path as the SmolLM2 and Mistral tokenizers. A ~100-token vocabulary lets a model of a few
hundred thousand parameters learn the task on two CPU cores in minutes, which a 49k-50k BPE
vocabulary (SmolLM2) would not: the output layer alone would dominate the compute.
"""
from __future__ import annotations

import string

from magistral_jax.model.tokenizer import HFTokenizer

SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")
WHOLE_TOKENS = ("<think>", "</think>", "\\boxed{")
# A plain "role: text" template, one turn per line; the assistant turn starts after "A:".
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Q: {{ m['content'] }}\n{% else %}A: {{ m['content'] }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}A: {% endif %}")


def char_tokenizer() -> HFTokenizer:
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
  vocab = {t: i for i, t in enumerate(list(SPECIAL) + chars)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in WHOLE_TOKENS])
  return HFTokenizer(tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                     chat_template=TINY_CHAT_TEMPLATE)
