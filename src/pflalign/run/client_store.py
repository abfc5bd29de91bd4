"""Per-client state on disk: one safetensors file per client, so memory does not grow with N.

Why: a client's method state and personalized adapter (pFLAlign on SmolLM2:
Δ_k, v, P and w_k, 4 × 19.5 MB) are needed only while the client trains or
is scored. Held for every client, they made memory and every round's
checkpoint grow with the number of clients (issue 21: 80 MB per client,
4.1 GB checkpoints at 64 clients). Here they live in the run folder and are
loaded when the client is sampled.

Layout: client k's record after round r (1-based rounds done) is
``clients/<k>.r<r>.safetensors``: tensors ``state/<group>/<name>`` and
``personalized/<name>``, the state's group names in the metadata. A file is
written when (and only when) its client trained, and never changed after:
the run checkpoint (`ClientStore.table`, inside ``checkpoint.pt``) names
each client's newest file with its sha256. Crash safety follows from that:
files written during a round that never reached a checkpoint are named by
none, so a resumed run reads the checkpoint's files and overwrites or
deletes the orphans; `prune` keeps every file that either checkpoint on disk
(``checkpoint.pt`` and ``checkpoint.prev.pt``) names, so falling back to the
previous checkpoint still finds its files. A file whose checksum does not
match is refused with one line.

Kept in memory (`memory_bytes` > 0, the in-process engine when checkpoints are not written
every round: `--checkpoint-every`, on CUDA by default): a record stays where it was trained, under
the name its file will have, until `flush` writes it (before each checkpoint, which then names
it), or is dropped unwritten when the client's next record replaces it. Why: on a GPU a SmolLM2
round trains in 1.1-1.7 s, and a pFLAlign client's 78 MB file written, hashed, read and hashed
again every round took 0.59 s on the CPU (benchmarks/client_files.py). `memory_bytes` bounds
what every store of the process holds together (runs in lockstep share it); a record beyond it
goes to its file at once, as without it.

The engine stays method-agnostic: a `State` is whatever groups of tensors
the method keeps; this module only stores them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from .. import checkpoint as ckpt
from ..checkpoint.atomic import _atomic_write
from ..errors import UserError
from ..params import Params, moved

log = logging.getLogger(__name__)

FOLDER = "clients"
_HELD = [0]  # bytes of records held in memory by all stores of this process (one bound for runs in lockstep)
_NAME = re.compile(r"^(\d+)\.r(\d+)\.safetensors$")


@dataclass
class ClientRecord:
    """What is kept of client k between its rounds: small fields in the checkpoint, tensors in its file."""

    name: str  # the client's name (results.json's "task")
    steps_taken: int = 0  # minibatches consumed: the data sampler's whole state
    truncated: int = 0  # its training examples cut at max_seq_len (known once tokenized)
    file: str | None = None  # its newest file in clients/ (None: it has not trained yet)
    sha256: str | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "steps_taken": self.steps_taken, "truncated": self.truncated,
                "file": self.file, "sha256": self.sha256}


def encode(state: dict, personalized: Params | None) -> bytes:
    """A client's state groups and personalized adapter as safetensors bytes."""
    # CPU for the writer: on CPU (the usual case) the tensors themselves, no copy; from a device one
    # transfer per group (`moved`), not one per tensor
    def host(group: Params) -> Params:
        return group if all(t.device.type == "cpu" for t in group.values()) else moved(group, "cpu")

    tensors = {f"state/{g}/{n}": t.detach() for g, group in state.items() for n, t in host(group).items()}
    if personalized is not None:
        tensors.update({f"personalized/{n}": t.detach() for n, t in host(personalized).items()})
    tensors = {k: t.contiguous() for k, t in tensors.items()}
    meta = {"format": "pflalign-client-1", "groups": json.dumps(list(state)),
            "personalized": "1" if personalized is not None else "0"}
    return save_bytes(tensors, metadata=meta)


def decode(data: bytes, device: torch.device | str = "cpu", order: Iterable[str] = ()) -> tuple[dict, Params | None]:
    """The inverse of `encode`: (state, personalized), each group one flat buffer on `device`
    (params.empty_like says why one buffer). A group of the names in `order` (the adapter's) holds
    them in that order, so that its flat buffer lines up with the adapter's (params.aligned);
    otherwise the file's order (safetensors' own)."""
    header_len = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + header_len]).get("__metadata__", {})
    flat = load_bytes(data)
    groups: dict[str, dict] = {g: {} for g in json.loads(meta.get("groups", "[]"))}
    personalized: dict | None = {} if meta.get("personalized") == "1" else None
    for key, t in flat.items():
        kind, _, rest = key.partition("/")
        if kind == "state":
            group, _, name = rest.partition("/")
            groups.setdefault(group, {})[name] = t
        else:
            personalized[rest] = t

    order = list(order)
    return ({g: _onto(p, device, order) for g, p in groups.items()},
            None if personalized is None else _onto(personalized, device, order))


def _onto(params: Params, device, order: list[str]) -> Params:
    """A copy of `params` on `device` as one flat buffer, in `order` when it names the same tensors
    (else their own order): one transfer (`moved`)."""
    names = order if params.keys() == set(order) else list(params)
    return moved({n: params[n] for n in names}, device)


def _nbytes(state: dict, personalized: Params | None) -> int:
    groups = [*state.values(), *([personalized] if personalized is not None else [])]
    return sum(t.numel() * t.element_size() for group in groups for t in group.values())


class ClientStore:
    """The clients' records of one run: the small fields in memory (a few numbers per client), the
    tensors in ``<out>/clients/``."""

    def __init__(self, out: Path | str | None, names: list[str], memory_bytes: int = 0):
        self.folder = None if out is None else Path(out) / FOLDER
        self.records = [ClientRecord(name) for name in names]
        self._kept_files: set[str] = set()  # named by the checkpoint on disk before the newest
        self.memory_bytes = memory_bytes  # records held unwritten up to this many bytes (0: none)
        # file name -> (k, state, personalized, bytes): records not yet written (`memory_bytes`)
        self._unwritten: dict[str, tuple[int, dict, Params | None, int]] = {}

    def attach(self, out: Path | str) -> None:
        """The run folder, when the store was made before it was known."""
        if self.folder is None:
            self.folder = Path(out) / FOLDER

    def __len__(self) -> int:
        return len(self.records)

    # ---- one client -----------------------------------------------------------------
    def load(self, k: int, device, order: Iterable[str] = ()) -> tuple[dict, Params | None] | None:
        """Client k's (state, personalized) from its newest file (`decode`: its groups of the
        adapter's names in `order`); None before its first round."""
        rec = self.records[k]
        if rec.file is None:
            return None
        if rec.file in self._unwritten:  # a copy: the caller's round changes its state in place
            _, state, personalized, _ = self._unwritten[rec.file]
            order = list(order)
            return ({g: _onto(group, device, order) for g, group in state.items()},
                    None if personalized is None else _onto(personalized, device, order))
        path = self.folder / rec.file
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise UserError(f"{path} is missing (client {k}, {rec.name!r}): the run's client files were "
                            "changed; it cannot be resumed; start again with --overwrite") from None
        if hashlib.sha256(data).hexdigest() != rec.sha256:
            raise UserError(f"{path} does not match its checksum in the checkpoint (client {k}, {rec.name!r}): "
                            "the file is damaged; start again with --overwrite")
        return decode(data, device, order)

    def save(self, k: int, rounds_done: int, state: dict, personalized: Params | None) -> None:
        """Write client k's record after round `rounds_done` (atomic; named by no checkpoint until the
        next save of the run's checkpoint), or keep it in memory until `flush` (`memory_bytes`). The
        store keeps `state` and `personalized` themselves then: the caller no longer changes them."""
        name = f"{k}.r{rounds_done}.safetensors"
        self._drop(self.records[k].file)  # replaced before any checkpoint named it
        if self.memory_bytes:
            size = _nbytes(state, personalized)
            if _HELD[0] + size <= self.memory_bytes:
                self._unwritten[name] = (k, state, personalized, size)
                _HELD[0] += size
                self.records[k].file, self.records[k].sha256 = name, None
                return
        try:
            self._write(k, name, state, personalized)
        except ckpt.DiskFull as exc:  # no checkpoint names this round's files yet: the last one is whole
            last = rounds_done - 1
            raise ckpt.DiskFull(f"{exc}; " + (f"the previous checkpoint (after round {last}) is intact; free some "
                                              "space, then continue with --resume (same --out)" if last > 0 else
                                              "no round is saved yet; free some space and start again")) from None

    def flush(self) -> None:
        """Write every record held in memory to its file (before a checkpoint names them)."""
        for name, (k, state, personalized, _) in list(self._unwritten.items()):
            self._write(k, name, state, personalized)  # (a full disk: the engine says which checkpoint is kept)
            self._drop(name)

    def discard(self) -> None:
        """Forget the records held in memory (a run that stops: its last checkpoint names its files)."""
        for name in list(self._unwritten):
            self._drop(name)

    def _drop(self, name: str | None) -> None:
        held = self._unwritten.pop(name, None)
        if held is not None:
            _HELD[0] -= held[3]

    def _write(self, k: int, name: str, state: dict, personalized: Params | None) -> None:
        data = encode(state, personalized)
        _atomic_write(self.folder / name, lambda f: f.write(data))
        self.records[k].file, self.records[k].sha256 = name, hashlib.sha256(data).hexdigest()

    # ---- the checkpoint's part ----------------------------------------------------
    def table(self) -> list[dict]:
        """The records for the run checkpoint (names the files it needs: `flush` first)."""
        if self._unwritten:
            raise RuntimeError("client records are still in memory: ClientStore.flush() before the checkpoint")
        return [r.to_dict() for r in self.records]

    def restore(self, table: list[dict]) -> None:
        if [t["name"] for t in table] != [r.name for r in self.records]:
            raise UserError(f"the checkpoint's clients ({len(table)}) are not the config's ({len(self.records)}): "
                            "the data changed since the run started; start again with --overwrite")
        self.records = [ClientRecord(**t) for t in table]
        self._kept_files = {r.file for r in self.records if r.file}

    def prune(self) -> None:
        """After a checkpoint was saved: delete the files that neither it nor the previous
        checkpoint names (older records, and orphans of a round that crashed)."""
        current = {r.file for r in self.records if r.file}
        keep = current | self._kept_files
        if self.folder.is_dir():
            for path in self.folder.iterdir():
                if _NAME.match(path.name) and path.name not in keep:
                    path.unlink(missing_ok=True)
            ckpt.remove_stale_temporaries(self.folder)
        self._kept_files = current


def client_records(out: Path, payload: dict, fresh_state=None) -> Sequence[dict]:
    """Every client's {"name", "state", "personalized", "steps_taken"} from a run checkpoint, in
    either format (clients in the checkpoint itself, before issue 21, or in clients/): for export
    and for tests. Client k's tensors are read from its file when item k is asked for and not
    kept, so going through the clients one at a time holds one client's tensors at a time. A
    client that never trained has no file: its personalized adapter is None and its state
    ``fresh_state()`` (None without it; the older format held the method's initial state)."""
    if "clients" in payload:  # the whole federation in the checkpoint (older runs)
        return payload["clients"]
    if out is None:
        raise ValueError("the run folder is needed: its clients' tensors are in <out>/clients/")
    store = ClientStore(out, [t["name"] for t in payload["client_records"]])
    store.restore(payload["client_records"])
    return _StoredClients(store, fresh_state)


class _StoredClients(Sequence):
    """`client_records`' clients: client k's tensors loaded from its file on each access."""

    def __init__(self, store: ClientStore, fresh_state):
        self.store, self.fresh_state = store, fresh_state

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        rec = self.store.records[k]
        loaded = self.store.load(k, "cpu")
        state, personalized = loaded if loaded is not None else (self.fresh_state and self.fresh_state(), None)
        return {"name": rec.name, "state": state, "personalized": personalized, "steps_taken": rec.steps_taken}


def tensors_in(obj) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of mappings and sequences: a checkpoint's ``global`` or
    ``server_state``, or `client_records`' clients (read from their files one at a time), e.g.
    to check the dtypes a run keeps (tests/test_mixed_precision.py, benchmarks/gpu.py)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        for v in obj:
            yield from tensors_in(v)
