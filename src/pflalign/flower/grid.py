"""Flower's Grid, looking for replies sooner on the Deployment Engine.

`Grid.send_and_receive` pushes the messages, then pulls their replies until
all are in. The Deployment Engine's grid (`HttpGrid`, flwr 1.41) sleeps 3 s
between two pulls, so a round ends on average 1.5 s (at most 3 s) after its
last reply reached the SuperLink; the Simulation Engine's grid
(`InMemoryGrid`) sleeps 0.1 s. Flower has no setting for it.
`PromptGrid` wraps a grid and does the same through the grid's own public
`push_messages` and `pull_messages`, pulling every `interval` seconds: the
same replies, found sooner. Each pull is one small request to the SuperLink;
every 0.5 s that is a few CPU milliseconds per second on each side.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

PULL_INTERVAL = 0.5  # seconds between two pulls for replies (HttpGrid: 3)


class PromptGrid(Grid):
    """`grid` with replies pulled every `interval` seconds; everything else is `grid`'s."""

    def __init__(self, grid: Grid, interval: float = PULL_INTERVAL):
        self.grid, self.interval = grid, interval

    def set_run(self, run) -> None:
        self.grid.set_run(run)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def get_nodes(self):
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """As Flower's: push, then pull until every message has its reply or `timeout` seconds
        have passed (None: no limit); the replies received."""
        waiting = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while waiting:
            got = list(self.pull_messages(waiting))
            replies += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if not waiting or (deadline is not None and time.monotonic() >= deadline):
                break
            time.sleep(self.interval)
        return replies


def prompt(grid: Grid) -> Grid:
    """The Deployment Engine's grid wrapped in `PromptGrid`; any other grid as it is."""
    from flwr.superlink.grid import HttpGrid

    return PromptGrid(grid) if isinstance(grid, HttpGrid) else grid
