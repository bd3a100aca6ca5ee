"""Tool use (issue #67): the protocol by which the policy calls a sandboxed Python interpreter
mid-reasoning (protocol.py)."""
