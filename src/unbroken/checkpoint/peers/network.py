"""The job's peer servers: one per node, found at start, with the job's token.

Made by every rank when the manager is made (collectives on the manager's group): rank
0 makes a token for this start of the job, every rank says which node it is on (its
host and memory tier: two staging directories on one machine are two nodes), the
lowest rank of each node with a memory tier starts the node's server, and every rank
learns every server's address. A one-node job (or ``replicas=0``) has none.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import selectors
import shutil
import socket
import subprocess
import warnings
from dataclasses import dataclass

from unbroken._util.collectives import Group
from unbroken._util.spawn import start_module
from unbroken.checkpoint.memory_tier import MemoryTier, node_key
from unbroken.checkpoint.peers import replica_files
from unbroken.checkpoint.peers.client import PeerClient
from unbroken.checkpoint.peers.peer_store import PeerStore
from unbroken.checkpoint.peers.placement import leaders, node_of_ranks, replica_targets
from unbroken.storage import LocalStore, Store

log = logging.getLogger(__name__)

HOST_ENV = "UNBROKEN_PEER_HOST"
"""The address this node's peer server listens on (default: this host's address on the
way to ``MASTER_ADDR``, the interface the job's own traffic takes)."""
START_SECONDS = 30.0


@dataclass
class PeerNetwork:
    """This rank's view of the job's peer servers."""

    node: int
    """This rank's node index."""
    node_count: int
    addresses: dict[int, tuple[str, int]]
    """Each node's server address, by node index (nodes without a memory tier: none)."""
    token: str
    replicas: int
    server: subprocess.Popen | None = None
    """This node's server, where this rank started it."""

    @classmethod
    def start(
        cls, group: Group, staging_dir: str, memory: MemoryTier | None, replicas: int
    ) -> PeerNetwork | None:
        """Collective: every rank calls it, with the same ``replicas``."""
        if group.world_size == 1 or replicas < 1:
            return None
        ident = f"{socket.gethostname()}:{node_key(staging_dir)}"
        token = group.broadcast(secrets.token_hex(32) if group.is_coordinator else None)
        identities = group.all_gather(ident)
        nodes = node_of_ranks(identities)
        node_count = max(nodes) + 1
        if node_count == 1:
            return None
        node = nodes[group.rank]
        server, address = None, None
        if leaders(nodes)[node] == group.rank and memory is not None and memory.active:
            host = node_host()
            machines = {i.rsplit(":", 1)[0] for i in identities}
            if len(machines) > 1 and _loopback(host):
                warnings.warn(
                    f"node {node}: its peer server listens on {host}, which the job's other "
                    f"machines cannot reach (MASTER_ADDR resolves to this machine's loopback "
                    f"here); set {HOST_ENV} to this node's address on the job's network",
                    RuntimeWarning,
                    stacklevel=3,
                )
            try:
                server, address = _start_server(memory.path, host, token)
            except Exception as e:
                warnings.warn(
                    f"node {node}: no peer server ({e}); its memory tier holds no replicas "
                    "and serves no peer",
                    RuntimeWarning,
                    stacklevel=3,
                )
        found = group.all_gather(address)
        addresses = {nodes[r]: (a[0], int(a[1])) for r, a in enumerate(found) if a is not None}
        log.info("node %d of %d; peer servers: %s", node, node_count, addresses)
        return cls(node, node_count, addresses, token, replicas, server)

    def replica_clients(self) -> list[PeerClient]:
        """Clients of the servers that keep this node's replicas."""
        targets = replica_targets(self.node, self.node_count, self.replicas, self.addresses)
        if len(targets) < min(self.replicas, self.node_count - 1):
            log.warning(
                "node %d: %d replica(s) asked, %d node(s) can hold one (the others have "
                "no memory tier or no peer server)", self.node, self.replicas, len(targets),
            )  # fmt: skip
        return [PeerClient(self.addresses[n], self.token) for n in targets]

    def peer_stores(self, fallback: Store) -> list[PeerStore]:
        """Every other node's server as a read-only store, for a restore."""
        return [
            PeerStore(PeerClient(address, self.token), fallback)
            for n, address in sorted(self.addresses.items())
            if n != self.node
        ]

    def close(self, drain_seconds: float = 0.0) -> None:
        """Stop this node's server, once the replicas arriving have landed (up to
        ``drain_seconds``: a preemption's last commit is the one a replacement needs)."""
        if self.server is not None and drain_seconds > 0 and self.node in self.addresses:
            client = PeerClient(self.addresses[self.node], self.token)
            try:
                client.drain(drain_seconds)
            except Exception as e:
                log.debug("peer server drain: %s", e)
            finally:
                client.close()
        if self.server is not None:
            self.server.kill()
            self.server.wait()
            self.server = None

    def stop_serving(self, memory: MemoryTier) -> None:
        """This node's memory tier went off (its tmpfs too small): its server stops and
        the replicas it took are removed, so that no peer fills the tmpfs the job was
        told it does not use. Peers then count their replicas to it as failed."""
        if self.server is None:
            return
        self.close()
        shutil.rmtree(replica_files.replicas_root(memory.path), ignore_errors=True)
        log.warning("node %d: the memory tier is off, so it keeps no peer's replicas", self.node)


def replica_stores(memory: MemoryTier | None) -> list[LocalStore]:
    """The replicas this node's memory tier holds, each as a store laid out like a tier."""
    if memory is None:
        return []
    return [LocalStore(d) for d in replica_files.replica_dirs(memory.path)]


def node_host() -> str:
    """Where this node's server listens: ``$UNBROKEN_PEER_HOST``, else the address this
    host reaches ``MASTER_ADDR`` from, or where that is loopback only because the name
    resolves so on this very machine, the default route's."""
    explicit = os.environ.get(HOST_ENV, "").strip()
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR", "").strip() or "127.0.0.1"
    host = _route_to(master) or "127.0.0.1"
    if _loopback(host) and not _loopback_name(master):
        # MASTER_ADDR names this machine, which /etc/hosts maps to loopback (Debian's
        # 127.0.1.1): the job's network is the default route's interface then.
        host = _route_to("192.0.2.1") or host  # TEST-NET: routed by default, never sent
    return host


def _route_to(target: str) -> str | None:
    """The source address this host would use to reach ``target`` (a UDP socket's
    route: no packet is sent)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(target, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(addr)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def _loopback_name(name: str) -> bool:
    """Whether ``name`` is written as loopback (not a host name that resolves to it)."""
    return name == "localhost" or _loopback(name)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _start_server(tier: str, host: str, token: str) -> tuple[subprocess.Popen, tuple[str, int]]:
    proc = start_module(
        "unbroken.checkpoint.peers.server", stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    settings = {"tier": tier, "host": host, "token": token, "parent": os.getpid()}
    try:
        proc.stdin.write((json.dumps(settings) + "\n").encode())
        proc.stdin.close()
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(START_SECONDS):
                raise TimeoutError(f"the peer server did not start within {START_SECONDS} s")
            line = proc.stdout.readline()
        port = int(json.loads(line)["port"])
    except Exception:
        proc.kill()
        proc.wait()
        raise
    return proc, (host, port)
