"""Communicators: one interface, two transports, every byte that moves counted.

The model code is rank-local (SPMD): every rank runs the same function against the
communicator it is handed, and the collectives below are the only places where ranks meet.

    all_reduce(x, op)        every rank ends with sum_j x_j (or the max)       x [...]
    all_gather(x, axis)      every rank ends with concat_j x_j along axis      x [..., n, ...]
    reduce_scatter(x, axis)  rank r ends with block r (along axis) of sum_j x_j
    broadcast(x, root)       every rank ends with x_root
    all_to_all(x, a, b)      block j of x along axis a goes to rank j; the arrivals are
                             concatenated along axis b in rank order
    all_to_allv(x, s, r)     rows: s[j] to rank j, r[i] from rank i  [sum s, ...] -> [sum r, ...]
    barrier()
    split(color, key)        sub-groups: the ranks that passed the same color (collective)
    subgroup(ranks)          the sub-group of the given ranks (called by its members only)
    iall_reduce(x, op)       non-blocking all_reduce: a Request now, request.wait() -> result

Algorithms (`algorithm=`), each run chunk by chunk over point-to-point messages, so the same
code moves the data in the simulation and under MPI and counts what it moves:

* ``"ring"``: the ranks form a ring r -> r+1. all_reduce = reduce-scatter (N-1 steps: at
  step s rank r sends chunk (r-s-1) mod N to its right and adds the chunk arriving from its
  left; after N-1 steps rank r holds the sum of chunk r) followed by all-gather (N-1 steps
  passing the finished chunks on). The M elements are cut into N chunks of sizes
  floor/ceil(M/N) (numpy.array_split's rule).
* ``"naive"``: everything goes through the root (group rank 0). all_reduce: every other rank
  sends its whole tensor to the root, the root adds them in rank order and sends the whole
  result back to every other rank. reduce_scatter: the same gather, then the root sends
  chunk j to rank j. all_gather: every other rank sends its chunk to the root, which sends
  the whole concatenation to every other rank. broadcast: the root sends to every rank.
* all_to_all and all_to_allv, under "ring" and "naive" alike: the pairwise exchange (an
  all-to-all adds nothing up, so nothing is routed through a ring or a root): at step
  s = 1..N-1 rank r sends its block for rank r+s straight to it and receives rank r-s's;
  empty blocks are not sent. Their records say ``algorithm="pairwise"``.
* ``"native"`` (MPI only): MPI's own collectives; their bytes cannot be observed from
  Python, so the records hold the payload only (``measured=False``).

Counting. Every message is counted where it moves: the sender adds its bytes to its
``sent`` and to the link (src -> dst) (global ranks), the receiver to its ``received``; each
collective call leaves a `CallRecord` with the bytes this rank sent and received during it.
Counts are per rank; a total is the sum over ranks (``total_traffic``).

Agreement (``check_calls``, on by default in both transports). A rank that calls a collective the
others do not call, or with another shape, dtype or root, would leave them waiting for
messages that never come. So before each collective every rank of the group gathers the
others' call header, (collective, shape, dtype, detail) in HEADER_SIZE int64 values, with
one small MPI_Allgather, and on any difference every rank raises the same ValueError, which
names what each side called. The headers are bookkeeping, not the algorithm's traffic: they
are not counted. The simulation checks the same way (``check_calls=False`` turns it off,
as ``--no-call-check`` does under MPI); its messages also carry their shapes, and a wait
that never ends there times out. all_to_allv's header holds the row shape (the number of
rows differs from rank to rank), and with check_calls the ranks then exchange their
(send_counts, recv_counts), uncounted as well, and refuse counts that do not match.

Non-blocking collectives (``iall_reduce``). The call copies its input and returns a
`Request` at once; the collective runs while the caller computes, and ``wait()`` returns
its result. With the ring or naive algorithm (simulated or MPI) the same code as the
blocking collective runs on a progress thread of the communicator, one request after the
other in the order they were started (as a CUDA stream runs NCCL calls), so its result
equals the blocking call's bit for bit; under MPI with ``"native"`` it is MPI_Iallreduce.
While requests are in flight, from the call that starts them to the wait() that returns
them, the caller must not start a blocking collective on the same communicator
(RuntimeError, whether or not the collective has already finished on the progress thread:
the refusal does not depend on timing): every rank starts the same requests in the same
order, and only the progress thread talks on that communicator until they are waited on.
Each rank's ``Traffic.events`` records, in the order its own thread saw them,
``("launch", label)``, ``("compute", label)`` (what the caller reports with
``record_compute``) and ``("wait", label)``/``("done", label)``: which computation ran
while which collective was in flight (``Traffic.overlaps()``); each Request keeps its
wall-clock times and how long ``wait()`` blocked (the exposed communication).
"""
from __future__ import annotations

import contextlib
import os
import collections
import queue
import sys
import threading
import time
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..backend import namespace, to_numpy

ALGORITHMS = ("ring", "naive")
OPS = ("sum", "max")

# A call header: [collective, dtype, ndim, shape (MAX_DIMS values, -1 beyond ndim; the last
# holds the product of any further axes), detail (op, root, axis or a hash of the bounds)]
CALLS = ("all_reduce", "reduce_scatter", "reduce_scatter_flat", "all_gather",
         "all_gather_flat", "broadcast", "barrier", "all_gather_object", "split",
         "all_to_all", "all_to_allv")
_DETAIL = dict(all_reduce="op", reduce_scatter="axis", reduce_scatter_flat="bounds hash",
               all_gather="axis", all_gather_flat="bounds hash", broadcast="root",
               all_to_all="axes")
_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
           "uint8", "bool", "complex128", "complex64")
MAX_DIMS = 8
HEADER_SIZE = 4 + MAX_DIMS


def chunk_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """[(start, stop)] of `parts` contiguous chunks of range(total), sizes ceil/floor(total/parts)
    with the larger ones first (numpy.array_split's rule)."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass
class CallRecord:
    """One collective as seen by one rank: what it moved during the call."""

    op: str
    algorithm: str
    group: str
    ranks: tuple
    elements: int              # elements of the logical tensor (M)
    itemsize: int
    sent: int = 0              # bytes this rank sent during the call
    received: int = 0          # bytes this rank received
    messages: int = 0          # point-to-point messages this rank sent
    links: Counter = field(default_factory=Counter)   # (src, dst) global ranks -> bytes
    measured: bool = True      # False for MPI's native collectives (payload only)


class Traffic:
    """What one rank moved, over all of its communicators (the world and its sub-groups)."""

    def __init__(self):
        self.sent = 0
        self.received = 0
        self.links: Counter = Counter()
        self.calls: list[CallRecord] = []
        self.events: list[tuple[str, str]] = []   # (kind, label), see record_compute
        self._local = threading.local()             # the call in progress, per thread
        self._lock = threading.Lock()               # a progress thread counts too
        self.current = None

    @property
    def current(self) -> CallRecord | None:
        """The collective in progress on the calling thread (a progress thread runs its
        own while the caller's thread runs others)."""
        return getattr(self._local, "record", None)

    @current.setter
    def current(self, record: CallRecord | None):
        self._local.record = record

    def reset(self):
        self.__init__()

    def overlaps(self) -> dict:
        """{request label: [labels of the computations recorded between its launch and
        the start of its wait()]}, from this rank's events."""
        out, open_ = {}, []
        for kind, label in self.events:
            if kind == "launch":
                out[label] = []
                open_.append(label)
            elif kind == "compute":
                for name in open_:
                    out[name].append(label)
            elif kind == "wait" and label in open_:
                open_.remove(label)
        return out

    def summary(self) -> dict:
        """{'sent', 'received', 'by_op': {(group, op): sent bytes}, 'links'}."""
        by_op: Counter = Counter()
        for c in self.calls:
            by_op[(c.group, c.op)] += c.sent
        return dict(sent=self.sent, received=self.received, by_op=dict(by_op),
                    links=dict(self.links))


def total_traffic(traffics) -> dict:
    """Sum of per-rank Traffic objects: total bytes sent (= total received) and per link."""
    links: Counter = Counter()
    for t in traffics:
        links.update(t.links)
    sent = sum(t.sent for t in traffics)
    received = sum(t.received for t in traffics)
    assert sent == received == sum(links.values()), "every byte sent must be received once"
    return dict(sent=sent, received=received, links=dict(links))


class Communicator:
    """The collectives, written once over four transport primitives (_isend, _wait, _recv,
    _exchange_objects) that SimulatedComm and MPIComm provide."""

    def __init__(self, rank: int, ranks: tuple, name: str, algorithm: str, traffic: Traffic):
        if algorithm not in ALGORITHMS + ("native",):
            raise ValueError(f"algorithm must be one of {ALGORITHMS + ('native',)}, "
                             f"got {algorithm!r}")
        self.rank = rank                      # this rank's index in the group
        self.ranks = tuple(ranks)             # global (world) ranks of the members, in order
        self.size = len(ranks)
        self.name = name
        self.algorithm = algorithm
        self.traffic = traffic
        self.check_calls = False              # the transports turn the agreement check on

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    def __repr__(self):
        return (f"{type(self).__name__}({self.name!r}, rank {self.rank} of {self.size}, "
                f"world ranks {self.ranks}, {self.algorithm})")

    # -- counting -----------------------------------------------------------------------
    def _count_send(self, dst: int, nbytes: int):
        link = (self.global_rank, self.ranks[dst])
        t = self.traffic
        current = t.current
        with t._lock:
            t.sent += nbytes
            t.links[link] += nbytes
        if current is not None:
            current.sent += nbytes
            current.messages += 1
            current.links[link] += nbytes

    def _count_recv(self, nbytes: int):
        current = self.traffic.current
        with self.traffic._lock:
            self.traffic.received += nbytes
        if current is not None:
            current.received += nbytes

    def _begin(self, op: str, elements: int, itemsize: int, measured=True) -> CallRecord:
        record = CallRecord(op, self.algorithm, self.name, self.ranks, int(elements),
                            int(itemsize), measured=measured)
        self.traffic.calls.append(record)
        self.traffic.current = record
        return record

    def _end(self):
        self.traffic.current = None

    # -- point to point, counted ---------------------------------------------------------
    def send(self, dst: int, x):
        """Start sending the 1-D array x to group rank dst; returns a handle for _wait."""
        self._count_send(dst, x.size * _itemsize(x))
        return self._isend(dst, x)

    def recv(self, src: int, size: int, like):
        """Receive a 1-D array of `size` elements of like's dtype from group rank src."""
        out = self._recv(src, size, like)
        self._count_recv(out.size * _itemsize(out))
        return out

    # -- the algorithms on a flat work buffer (in place) ----------------------------------
    @staticmethod
    def _combine(xp, a, b, op):
        return a + b if op == "sum" else xp.maximum(a, b)

    def _ring_reduce_scatter(self, xp, work, bounds, op):
        """After N-1 steps rank r holds the reduction of chunk r in work[bounds[r]]."""
        n, r = self.size, self.rank
        right, left = (r + 1) % n, (r - 1) % n
        for s in range(n - 1):
            a, b = bounds[(r - s - 1) % n]
            c, d = bounds[(r - s - 2) % n]
            handle = self.send(right, work[a:b])
            incoming = self.recv(left, d - c, work)
            work[c:d] = self._combine(xp, work[c:d], incoming, op)
            self._wait(handle)

    def _ring_all_gather(self, work, bounds):
        """Rank r starts with chunk r in place; after N-1 steps every chunk is everywhere."""
        n, r = self.size, self.rank
        right, left = (r + 1) % n, (r - 1) % n
        for s in range(n - 1):
            a, b = bounds[(r - s) % n]
            c, d = bounds[(r - s - 1) % n]
            handle = self.send(right, work[a:b])
            work[c:d] = self.recv(left, d - c, work)
            self._wait(handle)

    def _naive_reduce_to_root(self, xp, work, op):
        """Root: work <- reduction over ranks in rank order; others send their whole work."""
        if self.rank != 0:
            self._wait(self.send(0, work))
            return
        for src in range(1, self.size):
            work[...] = self._combine(xp, work, self.recv(src, work.shape[0], work), op)

    # -- public collectives ---------------------------------------------------------------
    def all_reduce(self, x, op: str = "sum"):
        """A new array, the elementwise sum (or max) of x over the group's ranks.  x [...]"""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        self._agree("all_reduce", x.shape, x.dtype, OPS.index(op))
        xp = namespace(x)
        work = _flat_copy(xp, x)                                         # [M]
        self._begin("all_reduce", work.shape[0], _itemsize(work))
        try:
            if self.size > 1:
                if self.algorithm == "native":
                    work = self._native("all_reduce", xp, work, op=op)
                elif self.algorithm == "ring":
                    bounds = chunk_bounds(work.shape[0], self.size)
                    self._ring_reduce_scatter(xp, work, bounds, op)
                    self._ring_all_gather(work, bounds)
                else:
                    self._naive_reduce_to_root(xp, work, op)
                    if self.rank == 0:
                        for handle in [self.send(d, work) for d in range(1, self.size)]:
                            self._wait(handle)
                    else:
                        work = self.recv(0, work.shape[0], work)
        finally:
            self._end()
        return xp.reshape(work, tuple(x.shape))

    def reduce_scatter_flat(self, x, bounds=None):
        """Chunk `rank` (bounds[rank], default chunk_bounds) of the sum over ranks of the
        1-D x [M]  ->  [stop - start]."""
        bounds = bounds or chunk_bounds(int(np.prod(x.shape)), self.size)
        self._agree("reduce_scatter_flat", x.shape, x.dtype, _bounds_code(bounds))
        return self._reduce_scatter_flat(x, bounds)

    def _reduce_scatter_flat(self, x, bounds):
        xp = namespace(x)
        work = _flat_copy(xp, x)
        _check_bounds(bounds, work.shape[0], self.size)
        a, b = bounds[self.rank]
        self._begin("reduce_scatter", work.shape[0], _itemsize(work))
        try:
            if self.size == 1:
                return work
            if self.algorithm == "native":
                return self._native("reduce_scatter", xp, work, bounds=bounds)
            if self.algorithm == "ring":
                self._ring_reduce_scatter(xp, work, bounds, "sum")
                return xp.asarray(work[a:b], copy=True)
            self._naive_reduce_to_root(xp, work, "sum")
            if self.rank == 0:
                handles = [self.send(d, work[bounds[d][0]:bounds[d][1]])
                           for d in range(1, self.size)]
                for handle in handles:
                    self._wait(handle)
                return xp.asarray(work[a:b], copy=True)
            return self.recv(0, b - a, work)
        finally:
            self._end()

    def all_gather_flat(self, chunk, bounds):
        """Rank r holds chunk r [stop_r - start_r] -> every rank gets the whole [M]."""
        self._agree("all_gather_flat", (bounds[-1][1],), chunk.dtype, _bounds_code(bounds))
        return self._all_gather_flat(chunk, bounds)

    def _all_gather_flat(self, chunk, bounds):
        xp = namespace(chunk)
        total = bounds[-1][1]
        _check_bounds(bounds, total, self.size)
        a, b = bounds[self.rank]
        if chunk.ndim != 1 or chunk.shape[0] != b - a:
            raise ValueError(f"rank {self.rank} must hold a 1-D chunk of {b - a} elements "
                             f"(bounds {bounds[self.rank]}), got shape {tuple(chunk.shape)}")
        self._begin("all_gather", total, _itemsize(chunk))
        try:
            if self.algorithm == "native" and self.size > 1:
                return self._native("all_gather", xp, chunk, bounds=bounds)
            work = xp.zeros((total,), dtype=chunk.dtype)
            work[a:b] = chunk
            if self.size == 1:
                return work
            if self.algorithm == "ring":
                self._ring_all_gather(work, bounds)
                return work
            if self.rank != 0:
                self._wait(self.send(0, chunk))
                return self.recv(0, total, work)
            for src in range(1, self.size):
                c, d = bounds[src]
                work[c:d] = self.recv(src, d - c, work)
            for handle in [self.send(dst, work) for dst in range(1, self.size)]:
                self._wait(handle)
            return work
        finally:
            self._end()

    def all_gather(self, x, axis: int = 0):
        """Concatenation along `axis` of every rank's x (all of the same shape)."""
        self._agree("all_gather", x.shape, x.dtype, axis)
        xp = namespace(x)
        size = int(np.prod(x.shape))
        bounds = [(i * size, (i + 1) * size) for i in range(self.size)]
        full = self._all_gather_flat(xp.reshape(x, (-1,)), bounds)
        pieces = [xp.reshape(full[a:b], tuple(x.shape)) for a, b in bounds]
        return xp.concat(pieces, axis=axis)

    def reduce_scatter(self, x, axis: int = 0):
        """Block `rank` along `axis` of the sum over ranks; x's size along axis must be a
        multiple of the group size.  x [..., n, ...] -> [..., n / N, ...]"""
        self._agree("reduce_scatter", x.shape, x.dtype, axis)
        xp = namespace(x)
        axis = axis % x.ndim
        n = x.shape[axis]
        if n % self.size:
            raise ValueError(f"reduce_scatter along axis {axis}: its size {n} must be a "
                             f"multiple of the group size {self.size}")
        step = n // self.size
        index = [slice(None)] * x.ndim
        parts = []
        for i in range(self.size):
            index[axis] = slice(i * step, (i + 1) * step)
            parts.append(xp.reshape(x[tuple(index)], (-1,)))
        flat = xp.concat(parts, axis=0)
        mine = self._reduce_scatter_flat(flat, [(i * parts[0].shape[0],
                                                 (i + 1) * parts[0].shape[0])
                                                for i in range(self.size)])
        shape = list(x.shape)
        shape[axis] = step
        return xp.reshape(mine, tuple(shape))

    def broadcast(self, x, root: int = 0):
        """Every rank gets root's x (others pass an array of the same shape and dtype)."""
        self._agree("broadcast", x.shape, x.dtype, root)
        xp = namespace(x)
        work = _flat_copy(xp, x)
        self._begin("broadcast", work.shape[0], _itemsize(work))
        try:
            if self.size > 1:
                if self.algorithm == "native":
                    work = self._native("broadcast", xp, work, root=root)
                elif self.algorithm == "naive":
                    if self.rank == root:
                        for h in [self.send(d, work) for d in range(self.size) if d != root]:
                            self._wait(h)
                    else:
                        work = self.recv(root, work.shape[0], work)
                else:   # a chain along the ring, starting at the root
                    position = (self.rank - root) % self.size
                    if position > 0:
                        work = self.recv((self.rank - 1) % self.size, work.shape[0], work)
                    if position < self.size - 1:
                        self._wait(self.send((self.rank + 1) % self.size, work))
        finally:
            self._end()
        return xp.reshape(work, tuple(x.shape))

    # -- all-to-all ----------------------------------------------------------------------------
    def all_to_all(self, x, split_axis: int = 0, concat_axis: int = 0):
        """Block j of x along split_axis goes to rank j; the blocks arriving from ranks
        0..N-1 are concatenated along concat_axis. Every rank passes the same shape, whose
        size along split_axis is a multiple of N.
        x [..., n, ...] (n along split_axis) -> [..., N m, ...] (along concat_axis), where
        the block is x's shape with n / N along split_axis and m its size along concat_axis.
        Its adjoint is all_to_all(dy, split_axis=concat_axis, concat_axis=split_axis)."""
        xp = namespace(x)
        if x.ndim < 1:
            raise ValueError("all_to_all needs x with at least one axis, got a scalar")
        split_axis = _axis("split_axis", split_axis, x.ndim)
        concat_axis = _axis("concat_axis", concat_axis, x.ndim)
        n = x.shape[split_axis]
        if n % self.size:
            raise ValueError(f"all_to_all: x's size {n} along split_axis {split_axis} must be "
                             f"a multiple of the group size {self.size}")
        self._agree("all_to_all", x.shape, x.dtype, split_axis * MAX_DIMS + concat_axis)
        step = n // self.size
        block = list(x.shape)
        block[split_axis] = step
        index = [slice(None)] * x.ndim
        pieces = []
        for j in range(self.size):
            index[split_axis] = slice(j * step, (j + 1) * step)
            pieces.append(xp.reshape(x[tuple(index)], (-1,)))
        size = int(np.prod(block))
        flat = xp.concat(pieces, axis=0) if pieces else xp.reshape(x, (-1,))      # [N size]
        out = self._all_to_all_flat("all_to_all", xp, flat, [size] * self.size,
                                    [size] * self.size)
        got = [xp.reshape(out[i * size:(i + 1) * size], tuple(block))
               for i in range(self.size)]
        return xp.concat(got, axis=concat_axis)

    def all_to_allv(self, x, send_counts, recv_counts):
        """Uneven all-to-all of rows: rows [s_0 + .. + s_{j-1}, s_0 + .. + s_j) of x go to
        rank j (s = send_counts); what rank i sends arrives as the i-th block of the result
        (r = recv_counts, r_i rows from rank i). Rank i's send_counts[j] must equal rank j's
        recv_counts[i]; with check_calls the ranks compare their counts first and every rank
        raises the same ValueError when they do not match.
        x [sum(s), ...] -> [sum(r), ...] (the same trailing shape and dtype on every rank).
        Its adjoint is all_to_allv(dy, recv_counts, send_counts)."""
        xp = namespace(x)
        if x.ndim < 1:
            raise ValueError("all_to_allv needs x with at least one axis (rows), got a scalar")
        send = _counts("send_counts", send_counts, self.size)
        recv = _counts("recv_counts", recv_counts, self.size)
        if sum(send) != x.shape[0]:
            raise ValueError(f"all_to_allv: send_counts {send} add up to {sum(send)} rows, "
                             f"but x has {x.shape[0]} rows (shape {tuple(x.shape)})")
        self._agree("all_to_allv", x.shape[1:], x.dtype, 0)
        if self.check_calls and self.size > 1:
            _match_counts(self._exchange_objects((send, recv)), self)
        row = int(np.prod(x.shape[1:]))
        flat = xp.reshape(x, (-1,))
        out = self._all_to_all_flat("all_to_allv", xp, flat, [c * row for c in send],
                                    [c * row for c in recv])
        return xp.reshape(out, (sum(recv),) + tuple(x.shape[1:]))

    def _all_to_all_flat(self, what, xp, flat, send, recv):
        """The pairwise exchange on a flat buffer: send[j] elements (in rank order) to rank
        j, recv[i] from rank i, concatenated in rank order. At step s = 1..N-1 rank r sends
        its block for rank r + s and receives the block of rank r - s (mod N), each block
        straight to its owner, as NCCL and MPI's pairwise algorithm do; an empty block is
        not sent (both sides know its count). An all-to-all adds nothing up, so there is no
        ring or root to route it through: 'ring' and 'naive' both run this schedule (its
        record says 'pairwise')."""
        n, r = self.size, self.rank
        offsets = [0]
        for c in send:
            offsets.append(offsets[-1] + c)
        record = self._begin(what, flat.shape[0], _itemsize(flat))
        try:
            if self.algorithm == "native" and n > 1:
                return self._native("all_to_allv", xp, flat, bounds=(send, recv))
            record.algorithm = "pairwise"
            blocks = [None] * n
            blocks[r] = xp.asarray(flat[offsets[r]:offsets[r + 1]], copy=True)
            for s in range(1, n):
                dst, src = (r + s) % n, (r - s) % n
                handle = None
                if send[dst]:
                    handle = self.send(dst, flat[offsets[dst]:offsets[dst + 1]])
                blocks[src] = (self.recv(src, recv[src], flat) if recv[src]
                               else xp.zeros((0,), dtype=flat.dtype))
                if handle is not None:
                    self._wait(handle)
            return xp.concat(blocks, axis=0) if n > 1 else blocks[0]
        finally:
            self._end()

    # -- non-blocking ------------------------------------------------------------------------
    def iall_reduce(self, x, op: str = "sum", label: str | None = None) -> "Request":
        """Start all_reduce(x, op) and return at once: request.wait() gives the result.
        x is copied now, so the caller may change it while the collective runs."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        xp = namespace(x)
        snapshot = xp.asarray(x, copy=True)
        label = label or f"all_reduce #{len(self.traffic.events)}"
        if self.algorithm == "native":
            return self._native_iall_reduce(xp, snapshot, op, label)
        self._check_threads()
        request = Request(self, label)
        if getattr(self, "_progress", None) is None:
            self._progress = _Progress()
        self._progress.submit(request, lambda: self.all_reduce(snapshot, op))
        return request

    def record_compute(self, label: str) -> None:
        """Note in this rank's events that the computation `label` has just finished (the
        timeline of what overlapped with which collective)."""
        self.traffic.events.append(("compute", str(label)))

    def _time_limit(self) -> float | None:
        return None

    def _check_threads(self) -> None:
        """The progress thread talks while the caller's thread may too (MPI overrides)."""

    def all_gather_object(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] for small Python objects (not counted)."""
        self._agree("all_gather_object")
        return self._exchange_objects(obj)

    def check_same(self, value: str, what: str) -> None:
        """Raise ValueError on every rank if the ranks hold different `value`s (a hash)."""
        values = self.all_gather_object(value)
        if len(set(values)) > 1:
            differing = [i for i, v in enumerate(values) if v != values[0]]
            raise ValueError(f"{what} differs across ranks: rank 0 has {values[0]!r}, "
                             f"rank(s) {differing} have {[values[i] for i in differing]!r}")

    def _agree(self, call: str, shape=(), dtype=None, detail: int = 0) -> None:
        """Before a collective (see Agreement in the module docstring): raise ValueError on
        every rank of the group when the ranks' call headers differ. A no-op unless
        check_calls is set, and for a group of one."""
        progress = getattr(self, "_progress", None)
        if progress is not None and progress.busy() and not progress.is_current():
            raise RuntimeError(
                f"{self!r}: {call} while non-blocking collectives are in flight on this "
                "communicator (started and not yet waited on); wait() for them first")
        if not self.check_calls or self.size == 1:
            return
        mine = _call_header(call, tuple(shape), dtype, detail)            # int64 [HEADER_SIZE]
        every = self._gather_headers(mine)                                 # [N, HEADER_SIZE]
        differ = np.flatnonzero((every != every[0]).any(axis=1))
        if differ.size:
            r = int(differ[0])
            raise ValueError(
                f"the ranks of group {self.name!r} called different collectives: group rank 0 "
                f"(world rank {self.ranks[0]}) called {_describe_call(every[0])}, group rank "
                f"{r} (world rank {self.ranks[r]}) called {_describe_call(every[r])}")

    def split(self, color: int, key: int | None = None, name: str | None = None):
        """The sub-group of the ranks that pass the same color, ordered by (key, rank).
        Every rank of this group must call it."""
        key = self.rank if key is None else key
        self._agree("split")
        entries = self._exchange_objects((color, key))
        members = sorted((k, r) for r, (c, k) in enumerate(entries) if c == color)
        members = tuple(self.ranks[r] for _, r in members)
        return self._make(members, name or f"{self.name}/{color}", color, key)

    def subgroup(self, ranks, name: str | None = None):
        """The group of the given group ranks (in this order); called by its members only."""
        ranks = tuple(int(r) for r in ranks)
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} called subgroup({ranks}) but is not a member")
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.size for r in ranks):
            raise ValueError(f"subgroup ranks must be distinct members of 0..{self.size - 1}, "
                             f"got {ranks}")
        members = tuple(self.ranks[r] for r in ranks)
        return self._make(members, name or f"{self.name}{list(ranks)}", None, None)


class Request:
    """A collective in flight (from iall_reduce). wait() blocks until it is done and returns
    its result (or raises its error); the seconds it blocked are `waited`, the exposed
    communication. Wall-clock times (time.perf_counter): launched, finished, wait_start."""

    def __init__(self, comm: Communicator, label: str):
        self.comm, self.label = comm, label
        self._done = threading.Event()
        self._result = None
        self._error: BaseException | None = None
        self._mpi = None                      # (MPI request, output buffer) for 'native'
        self.launched = time.perf_counter()
        self.finished: float | None = None
        self.wait_start: float | None = None
        self.waited = 0.0
        comm.traffic.events.append(("launch", label))

    def _finish(self, result=None, error=None):
        self._result, self._error = result, error
        self.finished = time.perf_counter()
        self._done.set()

    def test(self) -> bool:
        """True when the collective has finished (never blocks)."""
        if self._mpi is not None and not self._done.is_set() and self._mpi[0].Test():
            self._finish(self._mpi[1])
        return self._done.is_set()

    def wait(self):
        """Block until done; the result (the array all_reduce would have returned)."""
        if self.wait_start is not None:
            raise RuntimeError(f"request {self.label!r} was waited on already")
        self.wait_start = time.perf_counter()
        self.comm.traffic.events.append(("wait", self.label))
        limit = self.comm._time_limit()
        if self._mpi is not None:
            if not self._done.is_set():
                self.comm._complete(self._mpi[0], f"the non-blocking {self.label!r}")
                self._finish(self._mpi[1])
        else:
            while not self._done.wait(0.05):
                if limit is not None and time.perf_counter() - self.wait_start > limit:
                    raise TimeoutError(f"{self.comm!r} waited {limit:g} s for {self.label!r}")
        self.waited = time.perf_counter() - self.wait_start
        progress = getattr(self.comm, "_progress", None)
        if self._mpi is None and progress is not None:
            progress.release()                # no longer in flight for the caller
        self.comm.traffic.events.append(("done", self.label))
        if self._error is not None:
            raise self._error
        return self._result


class _Progress:
    """The progress thread of one communicator: runs submitted collectives one after the
    other, in submission order; it ends when the queue is empty (a new one starts later).
    busy() from submit() until the request's wait() returns, not until the collective
    finishes: whether a blocking call is refused must not depend on how fast it ran."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None
        self._pending = 0

    def busy(self) -> bool:
        with self._lock:
            return self._pending > 0

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, request: Request, work):
        with self._lock:
            self._queue.append((request, work))
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True)
                self._thread.start()

    def _run(self):
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                request, work = self._queue.popleft()
            try:
                result, error = work(), None
            except BaseException as err:      # noqa: BLE001 - raised by wait()
                result, error = None, err
            request._finish(result, error)

    def release(self):
        """A request was waited on: one fewer in flight."""
        with self._lock:
            self._pending -= 1


def _itemsize(x) -> int:
    return np.dtype(str(x.dtype).rsplit(".", 1)[-1]).itemsize


def _call_header(call, shape, dtype, detail):
    """The fixed-size description of one collective call: int64 [HEADER_SIZE]."""
    header = np.full(HEADER_SIZE, -1, dtype=np.int64)
    header[0] = CALLS.index(call)
    if dtype is not None:
        name = str(dtype).rsplit(".", 1)[-1]
        header[1] = _DTYPES.index(name) if name in _DTYPES else 100 + zlib.crc32(name.encode())
    header[2] = len(shape)
    dims = [int(d) for d in shape]
    if len(dims) > MAX_DIMS:
        dims = dims[:MAX_DIMS - 1] + [int(np.prod(dims[MAX_DIMS - 1:]))]
    header[3:3 + len(dims)] = dims
    header[-1] = int(detail)
    return header


def _describe_call(header) -> str:
    """'all_reduce(shape (4, 3), float64, op sum)' from a call header."""
    call = CALLS[int(header[0])]
    if header[1] < 0:
        return call
    code = int(header[1])
    dtype = _DTYPES[code] if code < len(_DTYPES) else f"dtype #{code}"
    ndim = int(header[2])
    shape = tuple(int(d) for d in header[3:3 + min(ndim, MAX_DIMS)])
    if ndim > MAX_DIMS:
        shape = shape[:-1] + (f"{shape[-1]} (axes {MAX_DIMS - 1}.. joined)",)
    detail = int(header[-1])
    label = _DETAIL.get(call)
    if call == "all_reduce":
        detail = OPS[detail]
    if call == "all_to_all":
        detail = f"split {detail // MAX_DIMS}, concat {detail % MAX_DIMS}"
    if call == "all_to_allv":
        return f"{call}(rows of shape {shape}, {dtype})"
    return f"{call}(shape {shape}, {dtype}, {label} {detail})"


def _bounds_code(bounds) -> int:
    """A hash of a chunk layout, so that ranks cutting a buffer differently disagree."""
    return zlib.crc32(repr([(int(a), int(b)) for a, b in bounds]).encode())


def _axis(name, axis, ndim) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not (
            -ndim <= axis < ndim):
        raise ValueError(f"{name} must be an axis of x (an integer in [-{ndim}, {ndim})), "
                         f"got {axis!r}")
    return int(axis) % ndim


def _counts(name, counts, size) -> list[int]:
    """`size` non-negative integers (a sequence or an integer array) as a list of ints, or
    a ValueError naming the argument."""
    try:
        values = (to_numpy(counts).reshape(-1).tolist() if hasattr(counts, "shape")
                  else list(counts))
    except TypeError:
        values = None
    if values is None or len(values) != size or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0
            for v in values):
        raise ValueError(f"{name} must be {size} non-negative integers (one per rank of the "
                         f"group), got {counts!r}")
    return [int(v) for v in values]


def _match_counts(every, comm) -> None:
    """every[i] = (send_counts, recv_counts) of group rank i: rank i's send_counts[j] must be
    rank j's recv_counts[i]; the same ValueError on every rank otherwise."""
    for i, (send, _) in enumerate(every):
        for j, (_, recv) in enumerate(every):
            if send[j] != recv[i]:
                raise ValueError(
                    f"all_to_allv counts do not match in group {comm.name!r}: group rank {i} "
                    f"sends {send[j]} rows to group rank {j}, which expects {recv[i]} rows "
                    f"from it (send_counts of rank {i}: {send}; recv_counts of rank {j}: "
                    f"{recv})")


def _flat_copy(xp, x):
    return xp.asarray(xp.reshape(x, (-1,)), copy=True)


def _check_bounds(bounds, total, size):
    if len(bounds) != size or bounds[0][0] != 0 or bounds[-1][1] != total or any(
            bounds[i][1] != bounds[i + 1][0] for i in range(size - 1)):
        raise ValueError(f"bounds must be {size} contiguous chunks covering 0..{total}, "
                         f"got {bounds}")


# ---------------------------------------------------------------------------------------
# The simulation: N ranks as threads of one process, messages through queues.


class _GroupState:
    """What the members of one simulated group share: a FIFO per link and a rendezvous."""

    def __init__(self, members):
        self.queues = {(a, b): queue.Queue() for a in members for b in members if a != b}
        self.barrier = threading.Barrier(len(members))
        self.slots: dict = {}                 # (exchange number, group rank) -> object
        self.exchanges: dict = {}             # group rank -> exchanges it has made


class _World:
    def __init__(self, size: int, timeout: float):
        self.size = size
        self.timeout = timeout
        self.lock = threading.Lock()
        self.groups: dict = {}
        self.failed = threading.Event()

    def group(self, key, members) -> _GroupState:
        with self.lock:
            if key not in self.groups:
                self.groups[key] = _GroupState(members)
            return self.groups[key]

    def abort(self):
        self.failed.set()
        with self.lock:
            for state in self.groups.values():
                state.barrier.abort()


class SimulatedComm(Communicator):
    """One rank's view of a simulated group (made by SimulatedGroup.run)."""

    def __init__(self, world: _World, rank, ranks, name, algorithm, traffic, key=None,
                 check_calls: bool = True):
        super().__init__(rank, ranks, name, algorithm, traffic)
        if algorithm == "native":
            raise ValueError("the simulated group runs 'ring' or 'naive' (native is MPI's own)")
        self.check_calls = bool(check_calls)
        self._world = world
        self._state = world.group(key or (self.ranks, name), self.ranks)

    def _time_limit(self):
        return self._world.timeout

    def _isend(self, dst, x):
        xp = namespace(x)
        self._state.queues[(self.global_rank, self.ranks[dst])].put(xp.asarray(x, copy=True))
        return None

    def _wait(self, handle):
        return None

    def _recv(self, src, size, like):
        q = self._state.queues[(self.ranks[src], self.global_rank)]
        waited = 0.0
        while True:
            if self._world.failed.is_set():
                raise RuntimeError("another rank failed")
            try:
                out = q.get(timeout=0.05)
                break
            except queue.Empty:
                waited += 0.05
                if waited > self._world.timeout:
                    raise RuntimeError(
                        f"{self!r} waited {self._world.timeout} s for a message from group "
                        f"rank {src}: the ranks did not call the same collectives") from None
        if out.shape != (size,) or str(out.dtype) != str(like.dtype):
            raise RuntimeError(f"{self!r} expected {size} elements of {like.dtype} from rank "
                               f"{src}, got shape {tuple(out.shape)} {out.dtype}: the ranks "
                               "called different collectives")
        return out

    def barrier(self):
        try:
            self._state.barrier.wait(timeout=self._world.timeout)
        except threading.BrokenBarrierError:
            if self._world.failed.is_set():
                raise RuntimeError(f"{self!r}: barrier broken (another rank failed)") from None
            raise RuntimeError(f"{self!r} waited {self._world.timeout} s for the other ranks "
                               "at a barrier: the ranks did not call the same collectives "
                               "(barrier broken)") from None

    def _exchange_objects(self, obj):
        """One barrier: exchange n of the group goes to slots (n, rank). A rank reads
        exchange n - 1 before it writes n, so once every rank has passed the barrier of n,
        nobody reads n - 1 again and each rank drops its own slot of it."""
        state = self._state
        n = state.exchanges[self.rank] = state.exchanges.get(self.rank, 0) + 1
        state.slots[(n, self.rank)] = obj
        self.barrier()
        out = [state.slots[(n, i)] for i in range(self.size)]
        state.slots.pop((n - 1, self.rank), None)
        return out

    def _gather_headers(self, header):
        return np.stack(self._exchange_objects(header))

    def _make(self, members, name, color, key):
        if self.global_rank not in members:
            raise RuntimeError("internal: a rank must be a member of its own new group")
        return SimulatedComm(self._world, members.index(self.global_rank), members, name,
                             self.algorithm, self.traffic, check_calls=self.check_calls)


class SimulatedGroup:
    """N ranks in one process, one thread each, exchanging messages through queues.

        group = SimulatedGroup(4, algorithm="ring")
        results = group.run(fn, *args)   # fn(comm, *args) on every rank; [result of rank r]
        group.traffic[r]                  # Traffic of rank r (sent, received, links, calls)

    check_calls (default on, as under MPI): the ranks compare every collective's call header
    first, so that a collective called with another shape, dtype, op or root on one rank
    fails on every rank naming both calls (see Agreement above).
    """

    def __init__(self, size: int, algorithm: str = "ring", timeout: float = 60.0,
                 check_calls: bool = True):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive integer, got {size!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.size = size
        self.algorithm = algorithm
        self.timeout = timeout
        self.check_calls = bool(check_calls)
        self.traffic = [Traffic() for _ in range(size)]

    def comms(self, world: _World) -> list[SimulatedComm]:
        ranks = tuple(range(self.size))
        return [SimulatedComm(world, r, ranks, "world", self.algorithm, self.traffic[r],
                              check_calls=self.check_calls)
                for r in range(self.size)]

    def run(self, fn, *args, **kwargs) -> list:
        """fn(comm, *args, **kwargs) on every rank at once; the list of their results.
        The first exception raised on any rank is raised here, naming the rank."""
        world = _World(self.size, self.timeout)
        comms = self.comms(world)
        results: list = [None] * self.size
        errors: list = [None] * self.size

        def body(r):
            try:
                results[r] = fn(comms[r], *args, **kwargs)
            except BaseException as err:   # noqa: BLE001 - re-raised in the caller
                errors[r] = err
                world.abort()

        if self.size == 1:
            body(0)
        else:
            threads = [threading.Thread(target=body, args=(r,), daemon=True)
                       for r in range(self.size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        secondary = ("another rank failed", "barrier broken")
        first = [(r, e) for r, e in enumerate(errors)
                 if e is not None and not any(s in str(e) for s in secondary)]
        first = first or [(r, e) for r, e in enumerate(errors) if e is not None]
        if first:
            rank, err = first[0]
            try:
                named = type(err)(f"rank {rank}: {err}")
            except TypeError:                    # an error made of more than a message
                raise err from None
            raise named from err
        return results

    def total(self) -> dict:
        return total_traffic(self.traffic)


# ---------------------------------------------------------------------------------------
# MPI: the same algorithms over mpi4py's point-to-point messages (or MPI's own collectives)


class MPIComm(Communicator):
    """One process's view of an MPI communicator.

    With algorithm 'ring' or 'naive' the collectives above run over Isend/Recv and are
    counted exactly as in the simulation (the same code decides what moves); with 'native'
    they call MPI_Allreduce and friends, and only the payload is recorded. check_calls
    (default on) gathers every rank's call header before each collective and raises
    ValueError on every rank when they differ (see Agreement above); sub-groups inherit it.
    A rank that raises should end the whole job (`abort_on_error`): the others cannot know.
    timeout (seconds, None for none) bounds every wait for a message or a call header, so
    that ranks stuck in collectives of different groups (which no header can compare) raise
    TimeoutError instead of waiting forever.
    """

    def __init__(self, mpi_comm=None, algorithm: str = "ring", name: str = "world",
                 ranks=None, traffic: Traffic | None = None, check_calls: bool = True,
                 timeout: float | None = 600.0):
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if ranks is None:
            ranks = tuple(self._comm.allgather(MPI.COMM_WORLD.Get_rank()))
        super().__init__(self._comm.Get_rank(), ranks, name, algorithm, traffic or Traffic())
        self.check_calls = bool(check_calls)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got "
                             f"{timeout!r}")
        self.timeout = timeout

    def _complete(self, request, what):
        """Wait for an MPI request, at most self.timeout seconds: polled (the first
        thousand polls at full speed, then every 0.1 ms) instead of a blocking wait."""
        if self.timeout is None:
            request.Wait()
            return
        polls, deadline = 0, None
        while not request.Test():
            polls += 1
            if polls < 1000:
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout
            elif now > deadline:
                raise TimeoutError(
                    f"{self!r} waited {self.timeout:g} s for {what}: a rank stopped calling "
                    "collectives, or the ranks are in collectives of different groups")
            time.sleep(1e-4)

    def _isend(self, dst, x):
        buf = np.ascontiguousarray(to_numpy(x))
        return (self._comm.Isend(buf, dest=dst, tag=7), buf)

    def _wait(self, handle):
        self._complete(handle[0], "a message to be delivered")

    def _recv(self, src, size, like):
        buf = np.empty(size, dtype=np.dtype(str(like.dtype).rsplit(".", 1)[-1]))
        self._complete(self._comm.Irecv(buf, source=src, tag=7),
                       f"a message from group rank {src}")
        return namespace(like).asarray(buf) if not isinstance(like, np.ndarray) else buf

    def _native(self, what, xp, work, op="sum", bounds=None, root=0):
        MPI = self._MPI
        host = np.ascontiguousarray(to_numpy(work))
        self.traffic.current.measured = False
        if what == "all_reduce":
            out = np.empty_like(host)
            self._comm.Allreduce(host, out, op=MPI.SUM if op == "sum" else MPI.MAX)
        elif what == "reduce_scatter":
            counts = [b - a for a, b in bounds]
            out = np.empty(counts[self.rank], dtype=host.dtype)
            self._comm.Reduce_scatter(host, out, recvcounts=counts, op=MPI.SUM)
        elif what == "all_gather":
            counts = [b - a for a, b in bounds]
            out = np.empty(bounds[-1][1], dtype=host.dtype)
            self._comm.Allgatherv(host, [out, counts])
        elif what == "all_to_allv":
            send, recv = bounds                  # elements to and from each rank
            out = np.empty(sum(recv), dtype=host.dtype)
            self._comm.Alltoallv([host, send], [out, recv])
        else:
            self._comm.Bcast(host, root=root)
            out = host
        return out if isinstance(work, np.ndarray) else xp.asarray(out)

    def _time_limit(self):
        return self.timeout

    def _check_threads(self):
        MPI = self._MPI
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("iall_reduce with the ring or naive algorithm runs on a "
                               "progress thread and needs MPI_THREAD_MULTIPLE (mpi4py's "
                               "default); this MPI was initialised with less")

    def _native_iall_reduce(self, xp, snapshot, op, label):
        """MPI_Iallreduce on a host copy; the record holds the payload only."""
        self._agree("all_reduce", snapshot.shape, snapshot.dtype, OPS.index(op))
        MPI = self._MPI
        host = np.ascontiguousarray(to_numpy(snapshot))
        out = np.empty_like(host)
        self.traffic.calls.append(CallRecord("all_reduce", "native", self.name, self.ranks,
                                             int(host.size), _itemsize(host), measured=False))
        request = Request(self, label)
        if self.size == 1:
            out[...] = host
            request._finish(out if isinstance(snapshot, np.ndarray) else xp.asarray(out))
            return request
        request._mpi = (self._comm.Iallreduce(host, out, op=MPI.SUM if op == "sum"
                                              else MPI.MAX), out)
        request._keep = host                  # MPI reads it until the request completes
        return request

    def barrier(self):
        self._agree("barrier")
        self._complete(self._comm.Ibarrier(), "the other ranks at a barrier")

    def _exchange_objects(self, obj):
        return self._comm.allgather(obj)

    def _gather_headers(self, header):
        every = np.empty((self.size, HEADER_SIZE), dtype=np.int64)
        self._complete(self._comm.Iallgather(header, every),
                       "the other ranks' next collective")
        return every

    def _make(self, members, name, color, key):
        if color is not None:
            sub = self._comm.Split(color, key)
        else:
            group = self._comm.Get_group().Incl([self.ranks.index(m) for m in members])
            sub = self._comm.Create_group(group)
        return MPIComm(sub, self.algorithm, name, members, self.traffic, self.check_calls,
                       self.timeout)


ABORT_GRACE_SECONDS = 1.0


@contextlib.contextmanager
def abort_on_error(stream=None):
    """Run an MPI rank's code so that an exception on any rank ends the whole job.

        with abort_on_error():
            train_parallel(MPIComm(), ...)

    Without it, a rank that raises leaves the others waiting forever for its messages (and
    its own exit waits in MPI_Finalize). Here the failing rank prints its traceback, then
    one line ``rank R: <type>: <message>`` to stderr, and calls MPI_Abort on COMM_WORLD,
    which ends every process of the job at once; mpiexec exits with status 1.
    """
    try:
        yield
    except BaseException as err:          # noqa: BLE001 - any failure must end the job
        from mpi4py import MPI

        stream = stream or sys.stderr
        rank = MPI.COMM_WORLD.Get_rank()
        report = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        stream.write(report + f"rank {rank}: {type(err).__name__}: {err}\n")   # one write
        stream.flush()
        # mpiexec forwards a rank's stderr through a proxy that MPI_Abort tears down at once:
        # give it a moment to pass the report on, or the job ends without saying why.
        time.sleep(ABORT_GRACE_SECONDS)
        MPI.COMM_WORLD.Abort(1)
        os._exit(1)                       # MPI_Abort may return before the job is torn down
