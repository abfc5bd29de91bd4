"""Which SuperNode is which client in a Flower run: each new SuperNode is asked its node config's
``partition-id`` with one ``query`` message, gone ones are forgotten, and a round waits (until
``connect-timeout`` after the start of the run) for the clients it samples that have never had a
SuperNode. `MethodStrategy` holds one `Nodes`."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from ..errors import UserError
from . import wire

log = logging.getLogger("flwr.pflalign")


class Nodes:
    """Which SuperNode is which client: asks new SuperNodes (one batch of ``query`` messages for
    all the SuperNodes that appeared since the last look), forgets gone ones."""

    def __init__(self, names: list[str], query_timeout: float = 120.0):
        self.names = names
        self.query_timeout = query_timeout
        self.of: dict[int, int] = {}  # client (partition-id) → SuperNode id
        self.seen: set[int] = set()  # clients that have had a SuperNode in this run (gone ones are not waited for)
        self.strangers: set[int] = set()  # SuperNodes that did not answer the query (not asked again)
        self.deadline: float | None = None  # `time.monotonic()` at which `wait` stops waiting (set by its first call)

    def name(self, k: int) -> str:
        return f"client {k} ({self.names[k]})"

    def connect(self, grid: Grid, need: Iterable[int] = (), deadline: float | None = None) -> list[int]:
        """Ask new SuperNodes which client they are, forget gone ones; until `deadline`
        (`time.monotonic()`; None: do not wait), wait for the clients of `need` that have never
        had a SuperNode. Returns those still without one."""
        need = sorted(set(need))
        last_log = time.monotonic()
        while True:
            live = set(grid.get_node_ids())
            self.of = {k: n for k, n in self.of.items() if n in live}
            new = sorted(live - set(self.of.values()) - self.strangers)
            if new:
                self._identify(grid, new)
            waiting = [k for k in need if k not in self.seen]
            if not waiting or deadline is None or time.monotonic() >= deadline:
                return waiting
            if time.monotonic() - last_log >= 30:
                last_log = time.monotonic()
                log.info("waiting for the SuperNodes of %d clients (%s); %.0f s left (connect-timeout)",
                         len(waiting), ", ".join(self.name(k) for k in waiting[:4]) + (", ..." if len(waiting) > 4
                                                                                      else ""),
                         deadline - time.monotonic())
            time.sleep(1.0)

    def _identify(self, grid: Grid, node_ids: list[int]) -> None:
        queries = [Message(RecordDict({"config": ConfigRecord()}), node, MessageType.QUERY) for node in node_ids]
        self.strangers.update(node_ids)  # until they answer
        found = []
        for reply in grid.send_and_receive(queries, timeout=self.query_timeout):  # one push, all the replies
            if reply.has_error():
                log.warning("a SuperNode did not say which client it is: %s", reply.error.reason)
                continue
            info = reply.content["info"]
            k, n, node = int(info["partition-id"]), int(info["num-partitions"]), reply.metadata.src_node_id
            self.strangers.discard(node)
            if n != len(self.names) or not 0 <= k < n:
                raise UserError(f"SuperNode {node} has partition-id={k} num-partitions={n}, but the run has "
                                f"{wire.describe_clients(self.names)}: start one SuperNode per client with "
                                f"partition-id=0 ... {len(self.names) - 1} num-partitions={len(self.names)} (on "
                                f"the Simulation Engine: num-supernodes={len(self.names)})")
            if k in self.of and self.of[k] != node:  # a restarted node, or a misconfigured one
                log.warning("SuperNode %d replaces SuperNode %d as %s", node, self.of[k], self.name(k))
            self.of[k] = node
            self.seen.add(k)
            found.append((k, node))
        for k, node in sorted(found)[:8]:
            log.info("SuperNode %d is %s", node, self.name(k))
        if len(found) > 8:
            log.info("... and %d more SuperNodes: %d of %d clients connected", len(found) - 8, len(self.of),
                     len(self.names))

    def unreached(self, clients: Iterable[int], timeout: float) -> dict[int, str]:
        """The clients of `clients` without a SuperNode now → why."""
        return {k: ("its SuperNode is not connected" if k in self.seen else
                    f"no SuperNode with partition-id={k} connected (waited up to connect-timeout={timeout:g} s "
                    "from the start of the run)")
                for k in clients if k not in self.of}

    def wait(self, grid: Grid, need: Iterable[int], timeout: float) -> dict[int, str]:
        """Pick up new and restarted SuperNodes, forget gone ones, and wait for the clients of
        `need` that have never had a SuperNode, until `timeout` seconds after the first call
        (the start of the run): a Flower run waits for the clients a round samples, not for
        all N. Returns the clients of `need` without a SuperNode → why (they count as missing)."""
        if self.deadline is None:
            self.deadline = time.monotonic() + timeout
        need = list(need)
        self.connect(grid, need, self.deadline)
        return self.unreached(need, timeout)
