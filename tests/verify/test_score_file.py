"""What verify/score_file.py writes is strict JSON: NaN and Infinity, which Python's json reads
in an input line, never come back as the non-JSON literals."""
import json
import math

from magistral_jax.rewards.reward import empty_parts
from magistral_jax.verify import score_file as score_mod


def _strict_loads(text):
  """json.loads that refuses NaN/Infinity/-Infinity, as a strict reader does."""
  def refuse(name):
    raise ValueError(f"not strict JSON: {name}")
  return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_are_written_as_strings_and_the_line_is_strict_json():
  raw = b'{"id": "n", "kind": "math", "problem": "p", "response": "r", "w": NaN, ' \
        b'"meta": {"hi": Infinity, "lo": [-Infinity, 1.5, [NaN]]}, "t": 2}'
  rec, args = score_mod.parse_line(raw, 4)
  assert not isinstance(args, str), args           # lenient reading: the line is scored
  assert math.isnan(rec["w"])
  text, err = score_mod.output_line(4, rec, 0.5, {**empty_parts(), "correct": math.inf}, None)
  assert err is None and text.isascii() and text.endswith("\n")
  row = _strict_loads(text)
  assert row["w"] == "NaN" and row["meta"] == {"hi": "Infinity", "lo": ["-Infinity", 1.5, ["NaN"]]}
  assert row["parts"]["correct"] == "Infinity" and row["reward"] == 0.5 and row["t"] == 2
  assert math.isnan(rec["w"])                      # the caller's record is left as it was


def test_finite_json_leaves_finite_values_alone_and_strict_dumps_refuses_nothing_it_maps():
  plain = {"a": [1, 2.5, None, True, "NaN"], "b": (1, 2)}
  assert score_mod.finite_json(plain) is plain      # nothing to replace: no copy
  assert _strict_loads(score_mod.strict_dumps(plain)) == {"a": [1, 2.5, None, True, "NaN"],
                                                          "b": [1, 2]}
  assert score_mod.strict_dumps(float("-inf")) == '"-Infinity"'
  assert score_mod.strict_dumps({"x": (math.nan,)}) == '{"x": ["NaN"]}'


def test_the_fallback_record_is_strict_json_too():
  deep = []
  for _ in range(5000):   # past the encoder's depth: the record is replaced by line and id
    deep = [deep]
  text, err = score_mod.output_line(7, {"id": "d", "meta": deep, "v": math.nan}, math.nan,
                                    empty_parts(), "scoring error")
  row = _strict_loads(text)
  assert row["line"] == 7 and row["id"] == "d" and row["reward"] == 0.0
  assert err.startswith("line 7: the record could not be written back") and row["error"] == err
