"""Shared by the sandbox tests."""
import pytest

from magistral_jax.rewards import sandbox


@pytest.fixture
def private_sandbox(monkeypatch):
  """(mode, uid_offset) -> a sandbox in one of both private-filesystem modes, "default" or
  "userns" (the user-namespace one is what a non-root host gets), made the process's default for
  the test; its slot uid is base + uid_offset (each test file its own, so files running side by
  side never share a uid)."""

  def make(mode: str, uid_offset: int) -> sandbox.Sandbox:
    s = sandbox.Sandbox(uid=sandbox.process_uid_base() + uid_offset)
    assert s.isolation in sandbox.PRIVATE_FS, s.isolation
    if mode == "userns":
      s.isolation = sandbox.ISOLATION_USERNS
    monkeypatch.setattr(sandbox, "_default", s)
    return s
  return make
