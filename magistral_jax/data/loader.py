"""grain loaders over the TFDS array_record datasets: RL problems and packed SFT sequences.

Both loaders shuffle (a fresh permutation every epoch), repeat (forever by default), and give
each data-parallel process a disjoint shard. Their position is a small JSON-serialisable dict
(`state()` / `restore(state)`) that the trainer saves with its checkpoint; restoring it continues
with exactly the element that would have come next.

Order of the grain pipeline and why:
  source (decodes lazily) -> shard (process i takes rows i, i+n, ...) -> shuffle(seed) -> repeat
Sharding first keeps every process on its own rows in every epoch; shuffling after it with the
same seed on every process needs no communication; `repeat` after `shuffle` makes grain draw a
new permutation per epoch (its shuffle is an index permutation keyed by seed + epoch).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

import grain
import numpy as np

from magistral_jax.data import tfds_builders
from magistral_jax.tool_use.protocol import encode_transcript

STATE_VERSION = 1


def _default_shard() -> tuple[int, int]:
  import jax  # only when the caller did not say which shard it is
  return jax.process_index(), jax.process_count()


PROGRAMMING_LANGUAGES = {"python": "Python 3", "cpp": "C++ (C++20)"}


def language_line(code_language: str) -> str:
  """The line a stdin/stdout statement ends with once posed in `code_language`."""
  return (f"\n\nWrite the program in {PROGRAMMING_LANGUAGES[code_language]}: it reads standard "
          "input and writes standard output.")


def problem_dict(kind: str, rec: Mapping[str, Any], code_language: str = "python") -> dict:
  """The RL pipeline's view of a record, in the task schema of `rewards.reward.compute_reward`.

  math: {"id", "kind": "math", "problem", "answer", "source", "natural_language"}
  code: {"id", "kind": "code", "problem", "answer": None, "language" (programming language),
         "source", "natural_language"} plus the tests: "tests" [{input, output}] for stdin/stdout
         problems, or "test_list" (assert programs) + "test_setup_code" for assert problems.
  A stdin/stdout statement gets one line naming the programming language to write, which is how
  one statement yields its Python and its C++ version (paper §3).
  """
  if kind == "math":
    return {"id": rec["id"], "kind": "math", "problem": rec["problem"], "answer": rec["answer"],
            "source": rec["source"], "natural_language": rec["language"]}
  if kind != "code":
    raise ValueError(f"problem datasets are math or code, not {kind!r}")
  if code_language not in PROGRAMMING_LANGUAGES:
    raise ValueError(f"code language {code_language!r} not in {sorted(PROGRAMMING_LANGUAGES)}")
  out = {"id": rec["id"], "kind": "code", "problem": rec["statement"], "answer": None,
         "language": code_language, "source": rec["source"], "natural_language": rec["language"]}
  if rec["test_type"] == "assert":
    if code_language != "python":
      raise ValueError(f"{rec['id']}: assert tests are Python only")
    out["test_list"] = [t["input"] for t in rec["tests"]]
    out["test_setup_code"] = rec["test_setup"]
  else:
    out["problem"] = rec["statement"].rstrip() + language_line(code_language)
    out["tests"] = rec["tests"]
    out["id"] = f"{rec['id']}#{code_language}"
  return out


class _Decoded:
  """A random-access source that decodes stored examples with `fn(kind, example)`."""

  def __init__(self, source, kind: str, fn):
    self._source, self._kind, self._fn = source, kind, fn

  def __len__(self):
    return len(self._source)

  def __getitem__(self, i):
    return self._fn(self._kind, tfds_builders.decode(self._kind, self._source[i]))


class _CodeVersions:
  """Code records times programming languages: index i is record i // L in language i % L.

  Assert-test records exist in Python only; their other slots are None, which grain skips.
  """

  def __init__(self, source, languages: Sequence[str]):
    self._source, self._langs = source, tuple(languages)

  def __len__(self):
    return len(self._source) * len(self._langs)

  def __getitem__(self, i):
    rec = tfds_builders.decode("code", self._source[i // len(self._langs)])
    lang = self._langs[i % len(self._langs)]
    if rec["test_type"] == "assert" and lang != "python":
      return None
    return problem_dict("code", rec, lang)


class _StatefulLoader:
  """Common iteration and checkpoint logic; subclasses build `self._ds` and `self._fingerprint`."""
  _ds: grain.IterDataset
  _fingerprint: dict

  def _start(self):
    self._it = iter(self._ds)

  def __iter__(self):
    return self

  def __next__(self):
    return next(self._it)

  def state(self) -> dict:
    """JSON-serialisable position; save it with the training checkpoint."""
    return {"version": STATE_VERSION, "loader": self._fingerprint,
            "iterator": self._it.get_state()}

  def restore(self, state: Mapping[str, Any]) -> None:
    """Continues from a `state()`; the loader must be built with the same data and settings."""
    if isinstance(state, (str, bytes)):
      state = json.loads(state)
    if state.get("version") != STATE_VERSION:
      raise ValueError(f"loader state version {state.get('version')!r}, expected {STATE_VERSION}")
    saved = json.loads(json.dumps(state["loader"]))
    ours = json.loads(json.dumps(self._fingerprint))
    if saved != ours:
      diff = {k: (saved.get(k), ours.get(k)) for k in set(saved) | set(ours) if saved.get(k) != ours.get(k)}
      raise ValueError(f"loader state does not match this loader (saved, current): {diff}")
    self._it.set_state(state["iterator"])


def _read_options(num_threads: int, prefetch: int) -> grain.ReadOptions:
  # grain's defaults (16 threads, 500 rows ahead) suit image pipelines; a prompt loader needs a
  # few rows ahead, and on a shared host idle threads decoding far ahead only steal CPU.
  return grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)


def _sharded(ds: grain.MapDataset, shard_index: int, shard_count: int) -> grain.MapDataset:
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index {shard_index} not in [0, {shard_count})")
  if len(ds) < shard_count:
    raise ValueError(f"{len(ds)} examples cannot be split over {shard_count} data-parallel shards")
  return ds[shard_index::shard_count]


def _epochs(ds: grain.MapDataset, num_epochs: int | None) -> grain.MapDataset:
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs must be >= 1 or None (forever), got {num_epochs}")
  return ds.repeat(num_epochs)


class ProblemLoader(_StatefulLoader):
  """Problem dicts for RL from built math/code datasets (mixed by concatenation, then shuffled).

  Args:
    data_dir: where the datasets were built (`tfds_builders.build_dataset`).
    names: dataset names; math and code datasets may be mixed.
    seed: shuffle seed; every process must use the same one.
    num_epochs: None repeats forever.
    shard_index, shard_count: this process's data-parallel shard (default: jax process index
      and count).
    code_languages: programming languages each stdin/stdout code problem is posed in (one
      problem per language); assert-test problems are posed in Python only.
    num_threads, prefetch: grain read threads and rows decoded ahead.
  """

  def __init__(self, data_dir: str, names: Sequence[str], *, seed: int = 0, shuffle: bool = True,
               num_epochs: int | None = None, shard_index: int | None = None,
               shard_count: int | None = None, split: str = "train",
               code_languages: Sequence[str] = ("python", "cpp"), num_threads: int = 2,
               prefetch: int = 32):
    if isinstance(names, str):
      names = [names]
    if shard_index is None or shard_count is None:
      shard_index, shard_count = _default_shard()
    bad = [l for l in code_languages if l not in PROGRAMMING_LANGUAGES]
    if bad or not code_languages:
      raise ValueError(f"code_languages {list(code_languages)}: choose from {sorted(PROGRAMMING_LANGUAGES)}")
    parts, sizes = [], {}
    for n in names:
      kind = tfds_builders.find_kind(data_dir, n)
      if kind not in ("math", "code"):
        raise ValueError(f"dataset {n!r} holds {kind} records; ProblemLoader reads math or code")
      src = tfds_builders.load_source(data_dir, n, kind=kind, split=split)
      if kind == "code":
        parts.append(grain.MapDataset.source(_CodeVersions(src, code_languages)))
      else:
        parts.append(grain.MapDataset.source(_Decoded(src, kind, problem_dict)))
      sizes[n] = len(src)
    ds = parts[0] if len(parts) == 1 else grain.MapDataset.concatenate(parts)
    ds = _sharded(ds, shard_index, shard_count)
    if shuffle:
      ds = ds.shuffle(seed=seed)
    self._ds = _epochs(ds, num_epochs).to_iter_dataset(_read_options(num_threads, prefetch))
    self._fingerprint = {"kind": "problems", "datasets": sizes, "split": split, "seed": seed,
                         "code_languages": list(code_languages),
                         "shuffle": shuffle, "num_epochs": num_epochs,
                         "shard": [shard_index, shard_count]}
    self._start()

  def take(self, n: int) -> list[dict]:
    """The next n problems (fewer only if a finite loader runs out)."""
    out = []
    for _ in range(n):
      try:
        out.append(next(self))
      except StopIteration:
        break
    return out


# ---- SFT: tokenise and pack ------------------------------------------------------------------
def sft_tokenize_fn(encode_prompt: Callable[[str], Sequence[int]],
                    encode_completion: Callable[[str], Sequence[int]], eos_id: int | None):
  """Maps a trace {prompt, completion} to {tokens, loss_mask}: the loss sees completion + EOS,
  less the tokens of the tool results in it (issue #67: a trace with interpreter calls is
  tokenized as the generator loop makes it, and a result is context, not a target).

  `encode_prompt` gives the full prompt ids (chat template, BOS); `encode_completion` plain ids.
  """
  def fn(rec: Mapping[str, str]) -> dict:
    p = list(encode_prompt(rec["prompt"]))
    c, actions = encode_transcript(rec["completion"], encode_completion)
    if eos_id is not None:
      c, actions = c + [eos_id], actions + [True]
    tokens = np.asarray(p + c, np.int32)
    mask = np.concatenate([np.zeros(len(p), np.int32), np.asarray(actions, np.int32)])
    return {"tokens": tokens, "loss_mask": mask}
  return fn


def chat_sft_tokenize_fn(tokenizer, system_prompt: str | None = None):
  """`sft_tokenize_fn` for a `model.tokenizer.Tokenizer`: prompts through its chat template.

  system_prompt None: the tokenizer's default (the paper's Magistral system prompt).
  """
  kw = {} if system_prompt is None else {"system_prompt": system_prompt}
  return sft_tokenize_fn(lambda p: tokenizer.apply_chat_template(p, **kw), tokenizer.encode,
                         tokenizer.eos_id)


def _truncate(seq_len: int):
  def fn(ex):
    # Keep the start: the prompt has to be seen for the completion tokens to be meaningful.
    return {k: v[:seq_len] for k, v in ex.items()}
  return fn


def _rename_packed(ex: dict) -> dict:
  # grain's packer emits per-feature segment ids/positions; tokens and loss_mask share them.
  return {"tokens": ex["tokens"], "loss_mask": ex["loss_mask"],
          "segment_ids": ex["tokens_segment_ids"], "positions": ex["tokens_positions"]}


def pack_sequences(ds: grain.IterDataset, seq_len: int, *, num_packing_bins: int = 16,
                   seed: int = 0) -> grain.IterDataset:
  """First-fit packing of {tokens, loss_mask} rows into rows of seq_len tokens.

  Output per row: tokens, loss_mask, segment_ids (0 = padding, 1.. = one per packed sequence)
  and positions (restarting at 0 in each segment): what `model.transformer.hidden_states` takes.
  """
  ds = ds.map(_truncate(seq_len))
  packed = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct={"tokens": seq_len, "loss_mask": seq_len},
      num_packing_bins=num_packing_bins, seed=seed, shuffle_bins=False)
  return packed.map(_rename_packed)


class SftLoader(_StatefulLoader):
  """Batches of packed, tokenised SFT traces: dicts of int32 [batch_size, seq_len] arrays."""

  def __init__(self, data_dir: str, names: Sequence[str], tokenize_fn, *, seq_len: int,
               batch_size: int, seed: int = 0, shuffle: bool = True,
               num_epochs: int | None = None, shard_index: int | None = None,
               shard_count: int | None = None, split: str = "train",
               num_packing_bins: int = 16, num_threads: int = 1, prefetch: int = 128):
    if isinstance(names, str):
      names = [names]
    if shard_index is None or shard_count is None:
      shard_index, shard_count = _default_shard()
    parts, sizes = [], {}
    for n in names:
      src = tfds_builders.load_source(data_dir, n, kind="sft", split=split)
      parts.append(grain.MapDataset.source(_Decoded(src, "sft", lambda k, r: r)))
      sizes[n] = len(src)
    ds = parts[0] if len(parts) == 1 else grain.MapDataset.concatenate(parts)
    ds = _sharded(ds, shard_index, shard_count)
    if shuffle:
      ds = ds.shuffle(seed=seed)
    ds = _epochs(ds, num_epochs).map(tokenize_fn).to_iter_dataset(_read_options(num_threads, prefetch))
    ds = pack_sequences(ds, seq_len, num_packing_bins=num_packing_bins, seed=seed)
    self._ds = ds.batch(batch_size, drop_remainder=True)
    self._fingerprint = {"kind": "sft", "datasets": sizes, "split": split, "seed": seed,
                         "shuffle": shuffle, "num_epochs": num_epochs,
                         "shard": [shard_index, shard_count], "seq_len": seq_len,
                         "batch_size": batch_size, "num_packing_bins": num_packing_bins}
    self._start()
