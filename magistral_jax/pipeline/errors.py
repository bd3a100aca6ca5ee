"""The pipeline's error: a component (generator thread, feeder, collector, a generator process,
a colocated phase) failed; the message names it and the cause carries the traceback."""


class PipelineError(RuntimeError):
  """A component of the pipeline failed (see the module docstring)."""
