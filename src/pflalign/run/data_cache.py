"""A client's data, read and tokenized once per host.

The Flower Deployment Engine starts a fresh ClientApp process for every
message; each read its client's share of the dataset (Dolly: a 13 MB JSON-lines
file) and tokenized its training examples again (Dolly's largest client:
about 0.4 s; the chat template runs per example). The result is kept in
``$PFLALIGN_CACHE/tokenized/<key>.json`` (``~/.cache/pflalign``): the client's
name, its train and test examples and their token ids. ``pflalign run`` uses
it too for the paper's federations (the natural partition on category, default
options); any other it loads whole, once per run.

The key covers everything the entry depends on: the SHA-256 of every data
file the loader reads (FLAN's ``local_training_*.json`` and ``test.jsonl``,
the Dolly ``.jsonl``, your own file or every data file in your folder; the
synthetic federation has none), the ``data.*`` settings but the path (the
files' content stands for it; the partition's settings among them:
``partition``, ``num_clients``, ``alpha``, ``seed``, ``test_set`` ...), which
client, ``max_seq_len``, the tokenizer (its serialized vocabulary, merges and
normalisation, its chat template, special tokens and class), the
transformers and tokenizers versions, this package's source (the loaders,
the partitioners, the prompt format) and, for a partition other than natural,
the flwr-datasets and NumPy versions (their draws). It is stored in the entry and compared on
every read; entries are written atomically (checkpoint.write_json), so a
half-written one never has the final name and a damaged or foreign one is
rebuilt. Sources this does not cover (a hub id, a missing file) are read and
tokenized as before.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Callable

from .. import checkpoint as ckpt
from ..data import Example
from ..data.registry import DATASETS
from ..data.clients import ClientShare, client_shares
from ..settings import RunConfig
from ..prompts import Encoded, encode_train

log = logging.getLogger(__name__)
FORMAT = 1  # the entry's layout; bump to invalidate every entry


@functools.cache  # once per process: the source does not change under a running process
def package_source_digest() -> str:
    """SHA-256 of every module of this package (a change of a loader or of the prompt format
    must not reuse old entries)."""
    root = Path(__file__).parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> str | None:
    """SHA-256 of what a tokenizer's ids depend on (about 20 ms for SmolLM2's; kept on the
    tokenizer); None for a tokenizer without a serializable backend (not cached)."""
    cached = getattr(tokenizer, "_pflalign_digest", None)
    if cached is not None:
        return cached
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    import tokenizers
    import transformers

    h = hashlib.sha256(json.dumps({
        "class": type(tokenizer).__name__, "chat_template": tokenizer.chat_template,
        "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
    }, sort_keys=True).encode())
    h.update(backend.to_str().encode())
    tokenizer._pflalign_digest = digest = h.hexdigest()
    return digest


def data_files(cfg: RunConfig, data_dir: str | None) -> list[Path] | None:
    """The files the loader reads for this federation, in order (its `Dataset.files`); None where
    this cache does not apply (a hub id, a missing file: those load as before). For your own files
    in a folder: every data file under it (Hugging Face's rules pick among them; a change to any
    of them is a miss)."""
    dataset = DATASETS.get(cfg.data.name)
    if dataset is None or dataset.files is None:
        return None
    files = dataset.files(Path(data_dir).expanduser() if data_dir else None)
    return files if files is not None and all(p.is_file() for p in files) else None


def cache_key(cfg: RunConfig, tokenizer, k: int, data_dir: str | None) -> dict | None:
    files = data_files(cfg, data_dir)
    tok = tokenizer_digest(tokenizer)
    if files is None or tok is None:
        return None
    # every data.* setting but the path: with the partition's (partition, num_clients, alpha, seed, ...)
    data = {key: value for key, value in dataclasses.asdict(cfg.data).items() if key != "dir"}
    folder = Path(data_dir).expanduser() if data_dir else None
    named = [str(p.relative_to(folder)) if folder and folder.is_dir() else p.name for p in files]
    key = {"format": FORMAT, "files": [[name, file_sha256(p)] for name, p in zip(named, files)],
           "data": data, "client": k, "max_seq_len": cfg.max_seq_len, "tokenizer": tok,
           "source": package_source_digest()}
    if cfg.data.partition != "natural":  # the draws are flwr-datasets' and numpy's (data/partition.py);
        # the natural partition draws nothing (each label's rows in table order)
        import flwr_datasets
        import numpy

        key["partitioner"] = {"flwr_datasets": flwr_datasets.__version__, "numpy": numpy.__version__}
    return key


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def entry_path(key: dict) -> Path:
    from ..model import cache_dir

    return cache_dir() / "tokenized" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest() + ".json")


def _read(path: Path, key: dict) -> tuple[ClientShare, list[Encoded]] | None:
    """The entry at `path` if it is complete and for `key`; None otherwise (absent, damaged, foreign)."""
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") != key:
            return None
        share = ClientShare(saved["name"], [_example(row) for row in saved["train"]],
                            [_example(row) for row in saved["test"]])
        encoded = [Encoded(list(ids), list(labels), bool(cut)) for ids, labels, cut in saved["encoded"]]
        if len(encoded) != len(share.train):
            return None
        return share, encoded
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _row(example: Example) -> list:
    """An example as JSON: [prompt, response], and a conversation's turns third."""
    row = [example.prompt, example.response]
    return row if example.messages is None else row + [[list(turn) for turn in example.messages]]


def _example(row: list) -> Example:
    prompt, response, *turns = row
    return Example(prompt, response, tuple(tuple(t) for t in turns[0]) if turns else None)


def encode(share: ClientShare, tokenizer, cfg: RunConfig) -> list[Encoded]:
    return [encode_train(tokenizer, ex, cfg.max_seq_len, cfg.data.template) for ex in share.train]


def client_data(cfg: RunConfig, tokenizer, k: int, data_dir: str | None = None,
                share: ClientShare | Callable[[], ClientShare] | None = None) -> tuple[ClientShare, list[Encoded]]:
    """Client k's share and its training examples' token ids: from the cache, else loaded
    (`share` when the caller has it already, or the function that makes it, called only on a
    miss; else client k's alone, `client_shares(..., which=[k])`) and tokenized, then cached.
    `data_dir` None: ``data.dir``."""
    data_dir = cfg.data.dir if data_dir is None else data_dir
    key = cache_key(cfg, tokenizer, k, data_dir)
    path = entry_path(key) if key is not None else None
    if path is not None and (hit := _read(path, key)) is not None:
        return hit
    if share is None:
        (share,) = client_shares(cfg, data_dir, which=[k])
    elif callable(share):
        share = share()
    encoded = encode(share, tokenizer, cfg)
    if path is not None:
        try:
            ckpt.write_json(path, indent=None, obj={"key": key, "name": share.name,
                                   "train": [_row(e) for e in share.train],
                                   "test": [_row(e) for e in share.test],
                                   "encoded": [[e.input_ids, e.labels, e.truncated] for e in encoded]})
        except (OSError, ckpt.DiskFull) as exc:  # a read-only or full cache costs time, never the run
            log.warning("cannot write the tokenized-data cache %s (%s)", path, exc)
    return share, encoded
