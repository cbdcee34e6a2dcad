"""A local three-node KRaft Kafka cluster: each node a combined broker+controller.

Beside the single ``KafkaBroker`` (same jars, same lifecycle: each node *is* a
``KafkaBroker`` with its own node id and the shared quorum), for the tests and
measurements that need replication: a node killed with SIGKILL while the others keep
serving, partition leaders and transaction coordinators that move (issue #35).

The three nodes form a three-voter controller quorum (``controller.quorum.voters``,
static), and the replication settings are those of a production cluster that survives
one node: replication factor 3 for new topics, the offsets topic and the transaction
state log, ``min.insync.replicas=2`` (and 2 for the transaction state log), so a write
with ``acks=all`` still succeeds with one node down and fails with two down.

``base_dir`` holds ``node-1``, ``node-2``, ... (each a ``KafkaBroker`` directory with its
state file), so a second process constructing a cluster on the same directory controls
the same nodes.

Finding the transaction coordinator of a transactional id (``find_coordinator``) is a
raw FindCoordinator v1 request (key type 1, TRANSACTION), like the metadata probe of
``devstack.kafka``: no Kafka client library in devstack, and the answer is the broker's
own, not a client's cached view.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from devstack._common import StackError, free_ports, read_json
from devstack.kafka import (
    KafkaBroker,
    _formatted_cluster_id,
    _kafka_string,
    _random_cluster_id,
    _Reader,
    _recv_exact,
)

__all__ = ["COORDINATOR_GROUP", "COORDINATOR_TRANSACTION", "ClusterNode", "KafkaCluster"]

COORDINATOR_GROUP = 0
COORDINATOR_TRANSACTION = 1
_STATE_FILE = "devstack-kafka.json"  # KafkaBroker's, read here to reuse a node's ports
# Kafka error codes that only mean "not yet" for FindCoordinator: COORDINATOR_LOAD_IN_PROGRESS
# (14), COORDINATOR_NOT_AVAILABLE (15, also while the internal topic is being created),
# NOT_COORDINATOR (16).
_RETRIABLE_FIND_ERRORS = frozenset({14, 15, 16})


class ClusterNode(KafkaBroker):
    """One node of a ``KafkaCluster``: a ``KafkaBroker`` with its own node id that votes
    in the cluster's controller quorum and replicates as a cluster does."""

    def __init__(
        self,
        base_dir: Path,
        *,
        node_id: int,
        port: int,
        controller_port: int,
        voters: str,
        cluster_id: str,
        extra_config: Mapping[str, str] | None = None,
        heap: str = "512m",
    ) -> None:
        self.node_id = node_id
        self.voters = voters
        super().__init__(
            base_dir,
            port=port,
            controller_port=controller_port,
            extra_config=extra_config,
            heap=heap,
        )
        # The cluster's id, unless this node's storage is formatted already (then that one:
        # the readiness check compares the two).
        self.cluster_id = _formatted_cluster_id(self.data_dir) or cluster_id

    def __repr__(self) -> str:
        return f"ClusterNode(node_id={self.node_id}, port={self.port})"

    def _quorum_voters(self) -> str:
        return self.voters

    def _config(self) -> dict[str, str]:
        config = super()._config()
        config.update(
            {
                "default.replication.factor": "3",
                "min.insync.replicas": "2",
                "offsets.topic.replication.factor": "3",
                "transaction.state.log.replication.factor": "3",
                "transaction.state.log.min.isr": "2",
                # Two cores for three JVMs: fewer threads than the defaults (3 network, 8 I/O).
                "num.network.threads": "2",
                "num.io.threads": "2",
                "background.threads": "2",
                # A transaction left open by a dead producer is aborted when it times out;
                # look for such transactions every 2 s rather than every 10 s.
                "transaction.abort.timed.out.transaction.cleanup.interval.ms": "2000",
            }
        )
        config.update(self.extra_config)
        return config

    def _jvm_command(self, java: Path, classpath: list[Path]) -> list[str]:
        jvm = super()._jvm_command(java, classpath)
        # C1 only: a short-lived test node starts faster and three of them share two cores.
        return [jvm[0], "-XX:TieredStopAtLevel=1", *jvm[1:]]


class KafkaCluster:
    """``size`` (default 3) KRaft nodes under ``base_dir``, each broker and controller.

    Nodes are addressed by index (0 .. size-1); node ``i`` has KRaft node id ``i + 1``.
    Usable as a context manager: ``with KafkaCluster(path) as cluster: ...`` starts every
    node and stops them on exit.
    """

    def __init__(
        self,
        base_dir: Path,
        *,
        size: int = 3,
        heap: str = "512m",
        extra_config: Mapping[str, str] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one node")
        self.base_dir = Path(base_dir).resolve()
        dirs = [self.base_dir / f"node-{i + 1}" for i in range(size)]
        states = [read_json(d / _STATE_FILE) for d in dirs]
        saved = [s.get(key) for s in states for key in ("port", "controller_port")]
        ports: list[int] = [p for p in saved if isinstance(p, int)]
        if len(ports) != 2 * size:
            # One call for every port: two nodes must not be handed the same one.
            ports = free_ports(2 * size)
        # Formatted storage first (the readiness check compares it), then a saved id.
        known = [
            _formatted_cluster_id(d / "data") or s.get("cluster_id")
            for d, s in zip(dirs, states, strict=True)
        ]
        cluster_id = next((c for c in known if isinstance(c, str)), None) or _random_cluster_id()
        voters = ",".join(f"{i + 1}@127.0.0.1:{ports[2 * i + 1]}" for i in range(size))
        self.nodes: list[ClusterNode] = [
            ClusterNode(
                dirs[i],
                node_id=i + 1,
                port=ports[2 * i],
                controller_port=ports[2 * i + 1],
                voters=voters,
                cluster_id=cluster_id,
                extra_config=extra_config,
                heap=heap,
            )
            for i in range(size)
        ]
        self.cluster_id = cluster_id

    def __repr__(self) -> str:
        return f"KafkaCluster(base_dir={str(self.base_dir)!r}, bootstrap={self.bootstrap!r})"

    @property
    def bootstrap(self) -> str:
        """Every node's ``host:port``, comma-separated, for ``bootstrap.servers``."""
        return ",".join(node.bootstrap_servers for node in self.nodes)

    def running(self) -> list[int]:
        """Indexes of the nodes whose JVM is alive."""
        return [i for i, node in enumerate(self.nodes) if node.is_running()]

    def start_all(self, timeout: float = 180.0) -> None:
        """Start every node at once (none is ready before a quorum of controllers is);
        on any failure kill them all and re-raise the first error."""
        with ThreadPoolExecutor(len(self.nodes), thread_name_prefix="kafka-node") as pool:
            futures = [pool.submit(node.start, timeout) for node in self.nodes]
            errors = [exc for f in futures if (exc := f.exception()) is not None]
        if errors:
            for node in self.nodes:
                with contextlib.suppress(Exception):
                    node.kill()
            raise errors[0]

    def start(self, index: int, timeout: float = 120.0) -> None:
        """Start node ``index`` (after ``kill``) and wait until it serves metadata."""
        self.nodes[index].start(timeout)

    def kill(self, index: int) -> None:
        """SIGKILL node ``index``, as a crash would."""
        self.nodes[index].kill()

    def stop(self, index: int, timeout: float = 30.0) -> None:
        """Stop node ``index`` cleanly (SIGTERM, SIGKILL after ``timeout``)."""
        self.nodes[index].stop(timeout)

    def stop_all(self, timeout: float = 30.0) -> None:
        """Stop every node; raise the first error only after trying them all."""
        errors: list[BaseException] = []
        # In parallel: the last node left alone, without a controller quorum, would wait
        # for one until its controlled-shutdown timeout.
        with ThreadPoolExecutor(len(self.nodes), thread_name_prefix="kafka-stop") as pool:
            futures = [pool.submit(node.stop, timeout) for node in self.nodes]
            errors = [exc for f in futures if (exc := f.exception()) is not None]
        if errors:
            raise errors[0]

    def find_coordinator(
        self,
        key: str,
        key_type: int = COORDINATOR_TRANSACTION,
        *,
        timeout: float = 30.0,
    ) -> int:
        """Index of the node that coordinates ``key`` (a transactional id, or a group id
        with ``key_type=COORDINATOR_GROUP``), asked of the live nodes in turn.

        The first lookup of a transactional id also creates the transaction state log;
        until it is there (or while a coordinator moves) the brokers answer "not
        available", which is retried until ``timeout``: then StackError. So is an answer
        that names a node this object knows to be dead (just after ``kill``, the survivors
        still name it until the controller fences it): the result is a live node.
        """
        deadline = time.monotonic() + timeout
        last = "no live node"
        while True:
            for node in self.nodes:
                if not node.is_running():
                    continue
                try:
                    error, node_id = find_coordinator(node.port, key, key_type)
                except (OSError, struct.error, UnicodeDecodeError) as exc:
                    last = f"node {node.node_id}: {type(exc).__name__}: {exc}"
                    continue
                if error == 0:
                    index = self._index_of(node_id)
                    if index is None:
                        raise StackError(f"coordinator of {key!r} is node {node_id}, not ours")
                    if self.nodes[index].is_running():
                        return index
                    # Killed a moment ago: the others name it until the controller fences
                    # it (broker.session.timeout.ms, 3 s) and moves its partitions.
                    last = f"node {node.node_id} names dead node {node_id}"
                    continue
                if error not in _RETRIABLE_FIND_ERRORS:
                    raise StackError(f"FindCoordinator({key!r}) failed with error code {error}")
                last = f"node {node.node_id}: error code {error}"
            if time.monotonic() >= deadline:
                raise StackError(f"no coordinator for {key!r} within {timeout:.0f}s ({last})")
            time.sleep(0.2)

    def _index_of(self, node_id: int) -> int | None:
        for index, node in enumerate(self.nodes):
            if node.node_id == node_id:
                return index
        return None

    def __enter__(self) -> KafkaCluster:
        self.start_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()


def find_coordinator(
    port: int, key: str, key_type: int = COORDINATOR_TRANSACTION, timeout: float = 2.0
) -> tuple[int, int]:
    """Send FindCoordinator v1 to 127.0.0.1:port; return (error code, coordinator node id)."""
    correlation_id = 0xC00D
    # Header v1: api_key 10 (FindCoordinator), api_version 1, correlation id, client id;
    # body: key (string), key_type (int8).
    request = struct.pack(">hhi", 10, 1, correlation_id) + _kafka_string("devstack-probe")
    request += _kafka_string(key) + struct.pack(">b", key_type)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(request)) + request)
        (size,) = struct.unpack(">i", _recv_exact(sock, 4))
        reader = _Reader(_recv_exact(sock, size))
    if reader.take(">i") != correlation_id:
        raise ConnectionError("FindCoordinator response with an unexpected correlation id")
    reader.take(">i")  # throttle_time_ms
    error = reader.take(">h")
    reader.string()  # error_message
    node_id = reader.take(">i")
    return error, node_id
