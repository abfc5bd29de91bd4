"""A ServerApp for tests/test_flower_privacy.py only: pflalign's ServerApp, with its Grid
wrapped so that every message the ServerApp receives is recorded, byte for byte, in
``<out>.received.pkl`` (a list of dicts: the sending node, the message type, and every
record's content: each Array's bytes, each config or metric value).

The test copies this file into a Flower app folder whose pyproject.toml names
``spy_server:app`` as the ServerApp (the ClientApp stays pflalign's)."""

from __future__ import annotations

import pickle
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

import pflalign
from pflalign.flower import server_app, wire

app = ServerApp()


def _record(reply) -> dict:
    if reply.has_error():
        return {"src": reply.metadata.src_node_id, "type": reply.metadata.message_type, "error": reply.error.reason}
    content = reply.content
    return {
        "src": reply.metadata.src_node_id,
        "type": reply.metadata.message_type,
        "arrays": {name: {k: bytes(a.data) for k, a in rec.items()} for name, rec in content.array_records.items()},
        "configs": {name: dict(rec) for name, rec in content.config_records.items()},
        "metrics": {name: dict(rec) for name, rec in content.metric_records.items()},
    }


class SpyGrid:
    """The ServerApp's Grid, recording every reply it hands over."""

    def __init__(self, grid: Grid, path: Path):
        self._grid, self._path, self.received = grid, path, []

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self.received += [_record(reply) for reply in replies]
        self._path.write_bytes(pickle.dumps(self.received))
        return replies

    def pull_messages(self, message_ids):
        replies = list(self._grid.pull_messages(message_ids))
        self.received += [_record(reply) for reply in replies]
        self._path.write_bytes(pickle.dumps(self.received))
        return replies


@app.main()
def main(grid: Grid, context: Context) -> None:
    out = Path(str({**wire.RUN_DEFAULTS, **context.run_config}["out"]))
    server_app.log.info("spy ServerApp: pflalign from %s", Path(pflalign.__file__).parent)
    server_app.main(SpyGrid(grid, out.with_name(out.name + ".received.pkl")), context)
