"""Tokenizers and the Magistral chat prompt.

One interface, `Tokenizer`, over two backends:
  * `MistralCommonTokenizer`: Mistral's own Tekken / SentencePiece tokenizers as shipped in
    mistral-common (`mistral_common/data/`), with mistral-common's chat-request encoding, so the
    prompt tokens are exactly what Mistral's models were trained on.
  * `HFTokenizer`: a HF `tokenizers.Tokenizer` (a tokenizer.json, or built from a GGUF file's
    embedded vocabulary) with the model's Jinja chat template.

The system prompt (paper Fig. 2) ends with "Problem:\n\n{problem}". We keep it verbatim and split
it at `{problem}`: the text before is the system message, the problem is the user message (with
any text after `{problem}` appended to it). The model thus reads the paper's words in the paper's
order, while the task stays in the user turn where chat templates (and the language-consistency
reward, which looks at the user's language) expect it. Mistral's Tekken V3 template itself
joins a system prompt onto the user turn with a blank line, so the "Problem:" heading lands
right above the problem there.
"""
from __future__ import annotations

import abc
import json
import os
from typing import Any, Sequence

from magistral_jax.model.gguf_file import default_gguf_path, read_gguf

MAGISTRAL_SYSTEM_PROMPT = (
    "A user will ask you to solve a task. You should first draft your thinking process (inner "
    "monologue) until you have derived the final answer. Afterwards, write a self-contained summary "
    "of your thoughts (i.e. your summary should be succinct but contain all the critical steps you "
    "needed to reach the conclusion). You should use Markdown and Latex to format your response. "
    "Write both your thoughts and summary in the same language as the task posed by the user.\n"
    "\n"
    "Your thinking process must follow the template below:\n"
    "<think>\n"
    "Your thoughts or/and draft, like working through an exercise on scratch paper. Be as casual and "
    "as long as you want until you are confident to generate a correct answer.\n"
    "</think>\n"
    "\n"
    "Here, provide a concise summary that reflects your reasoning and presents a clear final answer "
    "to the user.\n"
    "\n"
    "Problem:\n"
    "\n"
    "{problem}")

PROBLEM_PLACEHOLDER = "{problem}"


def chat_messages(problem: str, system_prompt: str | None = MAGISTRAL_SYSTEM_PROMPT
                  ) -> list[dict[str, str]]:
  """[system, user] messages for one problem (see the module docstring for the split)."""
  if not system_prompt:
    return [{"role": "user", "content": problem}]
  head, sep, tail = system_prompt.partition(PROBLEM_PLACEHOLDER)
  user = problem + tail if sep else problem
  # The blank line after "Problem:" is the templates' job (Tekken V3 joins system and user text
  # with "\n\n"), so trailing whitespace is not kept in the system message.
  return [{"role": "system", "content": head.rstrip()}, {"role": "user", "content": user}]


class Tokenizer(abc.ABC):
  """What the pipeline needs from a tokenizer."""

  @abc.abstractmethod
  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """Plain text -> ids (no EOS). Special-token strings in `text` are not given special ids by
    Mistral tokenizers; HF tokenizers match their added tokens (as HF does)."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    ...

  @abc.abstractmethod
  def apply_chat_template(self, problem: str,
                          system_prompt: str | None = MAGISTRAL_SYSTEM_PROMPT) -> list[int]:
    """Prompt ids for one problem, ending where the assistant's turn starts (BOS included if
    the model's format has one)."""

  bos_id: int | None
  eos_id: int
  pad_id: int
  vocab_size: int


# ---- mistral-common -----------------------------------------------------------------------------
def mistral_common_data_dir() -> str:
  import mistral_common
  return os.path.join(os.path.dirname(mistral_common.__file__), "data")


class MistralCommonTokenizer(Tokenizer):
  """Tekken (tekken_*.json) or SentencePiece (*.model.v*) tokenizer from mistral-common.

  `name_or_path`: a file path, or a file name inside mistral_common/data/ (shipped, offline).
  SentencePiece files need the `sentencepiece` package.
  """

  def __init__(self, name_or_path: str = "tekken_240911.json"):
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    path = name_or_path
    if not os.path.exists(path):
      path = os.path.join(mistral_common_data_dir(), name_or_path)
      if not os.path.exists(path):
        shipped = sorted(os.listdir(mistral_common_data_dir()))
        raise FileNotFoundError(f"no tokenizer file {name_or_path!r}; mistral-common ships {shipped}")
    self.path = path
    self._mistral = MistralTokenizer.from_file(path)
    self._tok = self._mistral.instruct_tokenizer.tokenizer
    self._policy = SpecialTokenPolicy
    self.bos_id = self._tok.bos_id
    self.eos_id = self._tok.eos_id
    # SentencePiece Mistral vocabularies have no pad token (-1): pads are masked out anyway, so
    # EOS is a safe filler.
    self.pad_id = self._tok.pad_id if self._tok.pad_id >= 0 else self._tok.eos_id
    self.vocab_size = self._tok.n_words

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    return list(self._tok.encode(text, bos=add_bos, eos=False))

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    policy = self._policy.IGNORE if skip_special_tokens else self._policy.KEEP
    return self._tok.decode([int(i) for i in ids], special_token_policy=policy)

  def apply_chat_template(self, problem: str,
                          system_prompt: str | None = MAGISTRAL_SYSTEM_PROMPT) -> list[int]:
    from mistral_common.protocol.instruct.messages import SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    kinds = {"system": SystemMessage, "user": UserMessage}
    messages = [kinds[m["role"]](content=m["content"]) for m in chat_messages(problem, system_prompt)]
    return list(self._mistral.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens)


# ---- HF tokenizers ------------------------------------------------------------------------------
def _token_str(tok: Any) -> str | None:
  if isinstance(tok, dict):
    return tok.get("content")
  return tok


class HFTokenizer(Tokenizer):
  """A `tokenizers.Tokenizer` plus the model's special tokens and Jinja chat template."""

  def __init__(self, tokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
               pad_token: str | None = None, chat_template: str | None = None,
               add_bos: bool = False, vocab_size: int | None = None):
    self.tokenizer = tokenizer
    self.chat_template = chat_template
    self._template, self._template_src = None, None  # compiled Jinja template, made on first use
    self.add_bos_default = add_bos
    ids = {}
    for role, tok in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token)):
      ids[role] = None if tok is None else tokenizer.token_to_id(tok)
      if tok is not None and ids[role] is None:
        raise ValueError(f"{role} token {tok!r} is not in the vocabulary")
    if ids["eos"] is None:
      raise ValueError("the tokenizer needs an EOS token (it ends every completion)")
    self.bos_token, self.eos_token = bos_token, eos_token
    self.bos_id, self.eos_id = ids["bos"], ids["eos"]
    self.pad_id = ids["pad"] if ids["pad"] is not None else ids["eos"]
    # The model's embedding can be larger than the vocabulary (padded to a multiple).
    self.vocab_size = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)

  # -- constructors --
  @classmethod
  def from_file(cls, path: str) -> "HFTokenizer":
    """A tokenizer.json (or a directory with tokenizer.json and tokenizer_config.json)."""
    from tokenizers import Tokenizer as _Tok
    directory, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else (
        os.path.dirname(path), path)
    try:
      tok = _Tok.from_file(file)
    except Exception as e:
      raise ValueError(f"cannot read tokenizer file {file}: {e}") from e
    conf = {}
    conf_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(conf_path):
      with open(conf_path) as f:
        conf = json.load(f)
    template = conf.get("chat_template")
    tmpl_path = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.exists(tmpl_path):
      with open(tmpl_path) as f:
        template = f.read()
    return cls(tok, bos_token=_token_str(conf.get("bos_token")),
               eos_token=_token_str(conf.get("eos_token")),
               pad_token=_token_str(conf.get("pad_token")), chat_template=template,
               add_bos=bool(conf.get("add_bos_token", False)))

  @classmethod
  def from_gguf(cls, path: str | None = None) -> "HFTokenizer":
    """The tokenizer embedded in a GGUF file (default: the shipped SmolLM2-135M-Instruct)."""
    path = path or default_gguf_path()
    return cls.from_gguf_metadata(read_gguf(path).metadata, path)

  @classmethod
  def from_gguf_metadata(cls, meta: dict[str, Any], path: str = "") -> "HFTokenizer":
    tok = tokenizer_from_gguf_metadata(meta, path)
    tokens = meta["tokenizer.ggml.tokens"]

    def name(key):
      i = meta.get(f"tokenizer.ggml.{key}")
      return None if i is None else tokens[i]

    return cls(tok, bos_token=name("bos_token_id"), eos_token=name("eos_token_id"),
               pad_token=name("padding_token_id"), chat_template=meta.get("tokenizer.chat_template"),
               add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))

  # -- interface --
  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    if add_bos:
      if self.bos_id is None:
        raise ValueError("add_bos=True but this tokenizer has no BOS token")
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The chat template applied to `messages` (text). Without jinja2, ChatML templates are
    rendered directly; any other template needs jinja2."""
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat template")
    try:
      import jinja2.sandbox  # noqa: F401
    except ImportError:
      if "<|im_start|>" not in self.chat_template:
        raise ImportError("rendering this chat template needs jinja2 (pip install Jinja2)") from None
      text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
      return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    return self._compiled_template().render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token or "", eos_token=self.eos_token or "")

  def _compiled_template(self):
    # Compiling the template costs far more than rendering it: do it once.
    if self._template is None or self._template_src != self.chat_template:
      import jinja2.sandbox

      def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

      # HF renders chat templates with these settings; keep them so the text matches.
      env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
      env.globals["raise_exception"] = raise_exception
      self._template = env.from_string(self.chat_template)
      self._template_src = self.chat_template
    return self._template

  def apply_chat_template(self, problem: str,
                          system_prompt: str | None = MAGISTRAL_SYSTEM_PROMPT) -> list[int]:
    # The template writes any BOS itself, so none is added here.
    return self.encode(self.render_chat(chat_messages(problem, system_prompt)))


# ---- GGUF vocabulary -> tokenizers.Tokenizer ----------------------------------------------------
# Pre-tokenizer split patterns by `tokenizer.ggml.pre`. None: GPT-2's own regex (ByteLevel's
# default). "digits": every digit on its own, then GPT-2's regex (SmolLM/StarCoder vocabularies;
# SmolLM2's tokenizer.json has the same Digits + ByteLevel sequence). The Llama 3 pattern is
# tiktoken's cl100k one; Tekken's is the "pattern" field of mistral-common's tekken_*.json.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                   r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                   r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
                   r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZERS = {
    "default": None, "gpt2": None, "gpt-2": None, "smollm": "digits", "starcoder": "digits",
    "llama3": _LLAMA3_PATTERN, "llama-v3": _LLAMA3_PATTERN, "llama-bpe": _LLAMA3_PATTERN,
    "tekken": _TEKKEN_PATTERN,
}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types


def tokenizer_from_gguf_metadata(meta: dict[str, Any], path: str = ""):
  """Builds a byte-level BPE `tokenizers.Tokenizer` from a GGUF's tokenizer.ggml.* metadata.

  Supports `tokenizer.ggml.model == 'gpt2'` (byte-level BPE: GPT-2, SmolLM, Llama 3, Tekken).
  Control tokens become special added tokens and user-defined ones plain added tokens, so both
  are matched whole in text.
  """
  from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
  from tokenizers import Tokenizer as _Tok
  kind = meta.get("tokenizer.ggml.model")
  if "tokenizer.ggml.tokens" not in meta:
    raise ValueError(f"GGUF {path} has no embedded vocabulary (tokenizer.ggml.tokens)")
  if kind != "gpt2":
    raise ValueError(f"GGUF {path}: tokenizer model {kind!r} is not supported (only 'gpt2', "
                     "byte-level BPE)")
  pre = meta.get("tokenizer.ggml.pre", "default")
  if pre not in GGUF_PRE_TOKENIZERS:
    raise ValueError(f"GGUF {path}: pre-tokenizer {pre!r} is not supported; "
                     f"known: {sorted(GGUF_PRE_TOKENIZERS)}")
  tokens = list(meta["tokenizer.ggml.tokens"])
  merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = _Tok(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  pattern = GGUF_PRE_TOKENIZERS[pre]
  if pattern is None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  elif pattern == "digits":
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  types = list(meta.get("tokenizer.ggml.token_type") or [])
  control = [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL]
  user = [AddedToken(t, special=False, normalized=False)
          for t, ty in zip(tokens, types) if ty == _GGUF_USER_DEFINED]
  if control:
    tok.add_special_tokens(control)
  if user:
    tok.add_tokens(user)
  return tok


def load_tokenizer(spec: str) -> Tokenizer:
  """'mistral:<file>' (mistral-common; file name in its data dir or a path), a .gguf file, a
  tokenizer.json, or a directory holding one."""
  if spec.startswith("mistral:"):
    return MistralCommonTokenizer(spec[len("mistral:"):])
  if spec.endswith(".gguf"):
    return HFTokenizer.from_gguf(spec)
  if os.path.basename(spec).startswith("tekken") or ".model.v" in os.path.basename(spec):
    return MistralCommonTokenizer(spec)
  return HFTokenizer.from_file(spec)
