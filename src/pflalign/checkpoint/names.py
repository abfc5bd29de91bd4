"""The names of a run folder's files (written by `pflalign.run.lifecycle.Recorder`, read back by
the analysis, the API and ``pflalign export``)."""

CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
MANIFEST = "checkpoint.json"
CONFIG = "config.json"
METRICS = "metrics.jsonl"
RESULTS = "results.json"
PREDICTIONS = "predictions.jsonl"
