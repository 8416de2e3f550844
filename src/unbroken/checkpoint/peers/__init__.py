"""A node's snapshot in another node's memory: replicas, and restores that read them.

Most failures kill a process, and the memory tier brings that rank back; a lost node
takes its memory tier with it. After each commit, every rank sends its own files of the
step from its node's memory tier to the peer server of the next node (``placement.py``),
which keeps them in its memory tier beside its own (``replica_files.py``). A replaced
node, or a job restarted on another number of nodes, reads each file from the nearest
place that holds it whole: its own memory, its disk, a peer's memory (``peer_store.py``),
and only then the durable tier.

One server per node (``server.py``, a process the node's lowest rank starts; it dies
with that rank), listening on the node's own address, answering only connections that
show the job's token (made by rank 0 at each start and shared over the job's own group).
Bytes move with ``sendfile`` from the tmpfs and are checked against their crc32c on
arrival and again by the reader.
"""
