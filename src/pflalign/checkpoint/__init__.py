"""A run folder's files, written so that a crash never leaves one half-written.

This package only hands names on (``from pflalign import checkpoint as ckpt``, then
``ckpt.load_run_checkpoint``, ``ckpt.METRICS``, ...), from its rooms:

* `names`: the files' names (``checkpoint.pt``, ``metrics.jsonl``, ``results.json``, ...);
* `atomic`: every file written to a temporary name, fsync'ed and renamed; a full disk is one
  `DiskFull` line; modes as the user's umask says;
* `packing`: a checkpoint's dicts of tensors saved as one flat tensor each (`save_checkpoint`,
  `load_checkpoint`);
* `run_checkpoint`: the run checkpoint, kept in two generations with a manifest of checksums
  (`save_run_checkpoint`, `load_run_checkpoint`), so that a resume always finds a good one;
* `resume_checks`: what the checkpoint that loads is checked against besides (NaN or Inf where no
  manifest vouches for it, metrics.jsonl holding its rounds);
* `metrics_log`: metrics.jsonl, appended round by round (`MetricsLog`) and read back (`metrics_rows`);
* `scoring`: the final scoring's finished jobs, kept as each finishes (`ScoringLog`), so that a
  resume scores only the rest;
* `stored`: a run file read as it is stored, plain or as the gzipped copy under docs/results.
"""

from .atomic import (NO_ROOM, DiskFull, follow_umask, fsync_dir, remove_stale_temporaries, umask,  # noqa: F401
                     umask_mode, write_json, write_jsonl)
from .metrics_log import MetricsLog, metrics_rows  # noqa: F401
from .names import CHECKPOINT, CONFIG, MANIFEST, METRICS, PREDICTIONS, PREVIOUS, RESULTS  # noqa: F401
from .packing import PACKED, load_checkpoint, pack_tensors, save_checkpoint, unpack_tensors  # noqa: F401
from .run_checkpoint import (has_run_checkpoint, load_run_checkpoint, newest_checkpoint_entry,  # noqa: F401
                             remove_run_checkpoints, rounds_checkpointed, save_run_checkpoint, sigint_deferred)
from .scoring import SCORING, ScoringLog, kept_jobs  # noqa: F401
from .stored import open_stored, read_stored_text, stored  # noqa: F401
