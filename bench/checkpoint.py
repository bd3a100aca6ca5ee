"""Benchmark: checkpoint import/export and tokenization against transformers on
SmolLM2-135M-Instruct's GGUF: GGUF import, HF safetensors save/load, orbax restore onto another
8-device layout (vs load + device_put), tokenizing MATH-500 and chat prompts.

  python bench/checkpoint.py

Last line: one JSON object with every number.
"""
import functools
import json
import os
import shutil
import sys
import tempfile

import common

common.use_cpu_devices(8)   # the orbax reshard needs 8 devices

import jax  # noqa: E402
import numpy as np  # noqa: E402

from magistral_jax.model.gguf_checkpoint import load_gguf  # noqa: E402
from magistral_jax.model.gguf_file import default_gguf_path  # noqa: E402
from magistral_jax.model.hf_checkpoint import load_hf_safetensors, save_hf_safetensors  # noqa: E402
from magistral_jax.model.hf_layout import params_to_hf  # noqa: E402
from magistral_jax.model.orbax_params import restore_params_orbax, save_params_orbax  # noqa: E402
from magistral_jax.model import tokenizer as tk  # noqa: E402


# (seconds, result) of one call. The results are host values (or waited for by the callable), and
# walking the tokenizers' long id lists for jax arrays would be timed too.
timed = functools.partial(common.time_once, block=False)


def main():
  common.argument_parser(__doc__).parse_args()
  import transformers
  transformers.logging.set_verbosity_error()
  res = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF)", "baseline": f"transformers {transformers.__version__}"}
  path = default_gguf_path()
  work = tempfile.mkdtemp()
  note = lambda *keys: print({k: res[k] for k in keys}, file=sys.stderr, flush=True)
  try:
    # -- GGUF import
    t_ours, (cfg, params, tok) = timed(lambda: load_gguf(path))
    t_hf, (model, hf_tok) = timed(lambda: (common.hf_causal_lm(path, "float32"),
                                          transformers.AutoTokenizer.from_pretrained(
                                              os.path.dirname(path),
                                              gguf_file=os.path.basename(path))))
    theirs = model.state_dict()
    ours = params_to_hf(params, cfg)
    diff = max(float(np.abs(ours[k] - theirs[k].numpy()).max()) for k in ours)
    res["gguf_import_s"] = {"ours": round(t_ours, 2), "transformers": round(t_hf, 2),
                            "max_abs_diff": diff}
    note("gguf_import_s")

    # -- HF safetensors, bf16
    bf16 = jax.tree.map(lambda x: x.astype("bfloat16"), params)
    d_ours, d_hf = os.path.join(work, "ours"), os.path.join(work, "hf")
    del model, theirs
    t_save_ours, _ = timed(lambda: save_hf_safetensors(bf16, cfg, d_ours))
    t_load_ours, (_, loaded) = timed(lambda: load_hf_safetensors(d_ours))
    t_load_hf, plain = timed(lambda: common.hf_causal_lm(d_ours, "bfloat16"))
    # (A GGUF-loaded transformers model refuses save_pretrained; save the plain one.)
    t_save_hf, _ = timed(lambda: plain.save_pretrained(d_hf))
    del plain
    res["hf_save_s"] = {"ours": round(t_save_ours, 2), "transformers": round(t_save_hf, 2)}
    res["hf_load_s"] = {"ours": round(t_load_ours, 2), "transformers": round(t_load_hf, 2)}
    note("hf_save_s", "hf_load_s")

    # -- orbax save on one layout, restore on another
    from magistral_jax.model import transformer
    from magistral_jax.parallel import config as parallel_config, sharding
    axes = transformer.param_logical_axes(cfg)
    src = sharding.param_shardings(axes, sharding.make_mesh({"fsdp": 2, "tensor": 4}),
                                   shapes_tree=loaded)
    dst = sharding.param_shardings(axes, sharding.make_mesh({"data": 4, "tensor": 2}),
                                   parallel_config.GENERATOR_RULES, shapes_tree=loaded)
    on_devices = jax.block_until_ready(jax.device_put(loaded, src))
    opath = os.path.join(work, "orbax", "params")
    t_osave, _ = timed(lambda: save_params_orbax(opath, on_devices, cfg))
    t_orestore, restored = timed(lambda: jax.block_until_ready(
        restore_params_orbax(opath, target_shardings=dst)))
    t_base, _ = timed(lambda: jax.block_until_ready(
        jax.device_put(load_hf_safetensors(d_ours)[1], dst)))
    same = all(np.array_equal(np.asarray(a), b) for a, b in
               zip(jax.tree.leaves(restored), jax.tree.leaves(loaded)))
    res["orbax_reshard_s"] = {"save": round(t_osave, 2), "restore_onto_new_mesh": round(t_orestore, 2),
                              "baseline_safetensors_load_plus_device_put": round(t_base, 2),
                              "values_equal": same}
    note("orbax_reshard_s")

    # -- tokenization
    with open(os.path.join(os.path.dirname(tk.__file__), "..", "data", "sources", "math500.jsonl")) as f:
      problems = [json.loads(line)["problem"] for line in f if line.strip()]
    t_tok_ours, ids_ours = timed(lambda: [tok.encode(p) for p in problems])
    t_tok_hf, ids_hf = timed(lambda: [hf_tok.encode(p, add_special_tokens=False) for p in problems])
    tekken = tk.MistralCommonTokenizer("tekken_240911.json")
    t_tekken, ids_tekken = timed(lambda: [tekken.encode(p) for p in problems])
    n = sum(map(len, ids_ours))
    res["tokenize_tokens_per_s"] = {
        "ours_gguf_tokenizer": round(n / t_tok_ours), "transformers_gguf_tokenizer": round(n / t_tok_hf),
        "tekken_mistral_common": round(sum(map(len, ids_tekken)) / t_tekken),
        "problems": len(problems),
        "problems_with_different_ids": sum(a != list(b) for a, b in zip(ids_ours, ids_hf))}
    # Chat prompts (system prompt + problem, up to the assistant turn), ms per prompt.
    sub = problems[:200]
    t_chat_ours, chat_ours = timed(lambda: [tok.apply_chat_template(p) for p in sub])
    t_chat_hf, chat_hf = timed(lambda: [list(hf_tok.apply_chat_template(
        tk.chat_messages(p), add_generation_prompt=True, tokenize=True, return_dict=False))
        for p in sub])
    res["chat_prompt_ms"] = {"ours": round(1e3 * t_chat_ours / len(sub), 3),
                             "transformers": round(1e3 * t_chat_hf / len(sub), 3),
                             "prompts_with_different_ids": sum(a != b for a, b in zip(chat_ours, chat_hf))}
    note("tokenize_tokens_per_s", "chat_prompt_ms")
  finally:
    shutil.rmtree(work, ignore_errors=True)
  common.emit(res)


if __name__ == "__main__":
  main()
