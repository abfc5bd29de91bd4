"""The one exception type that means "the user's input is wrong".

The CLI turns it into a single line on stderr and exit status 2; everything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: a file, a config key, a category, a value."""


class TrainingDiverged(UserError):
    """A NaN or Inf appeared in a loss, a gradient, the weights or an update: usually a too large learning rate."""


class OutOfMemory(UserError):
    """A client's training or scoring ran out of memory (CUDA's allocator, or a CPU MemoryError);
    the message names the settings that set its size and what to lower."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run, caught once the run directory is consistent; the message says how to resume."""
