"""The replicated memory tier (issue 42): recovery after a node loss, and the training step while a replica is sent.

One command, two parts, in the same run (``--only`` picks one):

**Recovery** of a state of ``--size-mb`` (default ~1 GB) by the rank whose node was lost, in a fresh process of
a 2-process gloo job on 127.0.0.1 (rank 0: the replaced node, its memory dir empty; rank 1: the peer holding
rank 0's replica in its memory dir), ``--repeats`` times, the sources interleaved (order rotated per repeat):

- *peer replica*: the recovery as ``MemoryTier.choose`` runs it: both ranks offer what their memory holds, verified
  (``memory.peers.offer``, each file checked a chunk at a time; rank 1 also holds its own snapshot of the same
  save), the offers are gathered and planned (``memory.recover.plan_recovery``), and the plan is carried out
  (``memory.peers.carry_out``: the holder streams the replica over the transfer group with ``memory.transport``,
  the owner installs it as its own snapshot with ``MemoryStore.write_received``, every digest checked as it
  arrives); then the owner reads it once, unhashed, from the descriptor it was checked through, its weights
  straight into the module a relaunched process built (``MemoryStore.load(into=...)``); timed on rank 0 from the
  barrier before the offers until the module holds the state, and split into offers + plan, transfer + install,
  and the load;
- *local durable*: ``SafetensorsCheckpointIO().load_checkpoint`` of the same state on local disk, verified, its
  weights read into the same module (``load_into``, as a durable resume reads them), by rank 0 alone (a lower
  bound for a durable recovery, where every rank reads at once):
  *cold* (the file's pages dropped from the page cache first with ``posix_fadvise(DONTNEED)``, as a relaunched
  process on another node finds it) and *warm* (read again at once, from the page cache: the hardest bar);
- *S3*: the same load from the moto S3 server on 127.0.0.1 (``s3://``, through s3fs, as the product reads remote
  checkpoints; the server runs in this parent process, idle meanwhile, the loader in the worker);
- for scale, not goals: the *bare transfer* (the same bytes over a gloo group into a tmpfs file: no format, no
  digest, no load: this machine's limit for the transfer) and one *raw S3 GET* of the object (no format, no
  verification: this server's limit).

Goal (issue 42): peer replica >= 5x faster than S3 and no slower than the local durable read.

**Step time** in a Lightning fit: 2 processes as 2 nodes (``NODE_RANK`` 0 and 1, one rank each, gloo, each node
its own memory dir), an MLP of ``--fit-params-mb`` fp32 weights with AdamW (a state of about 3x that), one CPU
thread, ``ExactResume(memory_tier=MemoryTierOptions(replicas=1, every_n_train_steps_max=E))``: a memory
snapshot every ``--every`` steps, each replicated to the other node in the background. Halfway between
snapshots, a bare callback runs this machine's limit beside the same fit: each rank sends its newest snapshot
file's bytes to the other over a gloo group of its own and writes what it receives into tmpfs (a thread; no
format, no digest). Each step's wall time is taken from one batch start to the next, with what was in flight at
its start: the local snapshot's write, a replica transfer, the bare transfer. Calm steps: nothing in flight, not
a snapshot's step nor a bare start's. Reported over the calm step's median: the snapshot step (the memory tier's
own copy, C1, not the replica's), the steps with a replica in flight, the steps with the local write in flight
(no replica yet), the steps with the bare transfer in flight (the limit). Goal: replica in flight <= 1.03x, or
at the limit measured beside it.

``--copy`` reads every source into new memory and then copies the weights into the module, as the recovery did
before it read in place. The last line is the verdict. ``--quick`` is a small run that checks that the benchmark still works (a test
runs it); its figures mean nothing.

Usage: ``python benchmarks/bench_replica.py`` (~1 GB state, 3 repeats; 7-11 minutes on a 2-core VM, most of it
the S3 load on moto), ``--size-mb 256`` to shrink it, ``--quick``. Needs ``moto[server]`` and ``s3fs`` for the S3 row (skipped, said, without them).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from benchmarks.flat_state import Wide, flat_state  # noqa: E402
from lightning_resume import ExactResume, MemoryTierOptions, SafetensorsCheckpointIO, collective  # noqa: E402
from lightning_resume.io.plugin import destinations  # noqa: E402
from lightning_resume.memory import peers, transport  # noqa: E402
from lightning_resume.memory.recover import RecoveryPlan, plan_recovery  # noqa: E402
from lightning_resume.memory.store import MemoryStore, memory_root, replica_name, slot_key  # noqa: E402
from tests.helpers.paths import free_port  # noqa: E402

CHUNK = 16 << 20
"""The bare transfer's chunk (bytes)."""

RUN = "bench-replica"
STEP, SEQ, DURABLE_STEP = 100, 7, 90
"""The memory snapshot's save, and the older durable checkpoint's step: the node was lost between durable saves."""
OFFERS, CARRY_OUT, LOAD = (
    "of which: offers verified + plan",
    "of which: transfer + install (checked as it arrives)",
    "of which: the load into the module",
)
REPLICA, COLD, WARM, S3, BARE, RAW_S3 = (
    "peer replica (recovery)",
    "local durable, cold",
    "local durable, warm",
    "S3 (moto)",
    "bare transfer (limit)",
    "raw S3 GET (limit)",
)


# ---------------------------------------------------------------------------------------------------------- recovery


def prepare_recovery(size_mb: int, work: str, disk: str, s3_url: Optional[str]) -> Dict[str, Any]:
    """Write the state where each source keeps it: rank 0's snapshot (its bytes become rank 1's replica of it,
    then node 0's memory is emptied: the node loss), the durable file on local disk, the object on S3."""
    state = flat_state(size_mb)
    nodes = [os.path.join(work, f"node{i}") for i in range(2)]
    durable_dir = os.path.join(disk, "durable")
    os.makedirs(durable_dir)
    key = slot_key(durable_dir)
    owner = MemoryStore(memory_root(nodes[0]), key, rank=0, world_size=2, asynchronous=False)
    nbytes = owner.save(state, step=STEP, seq=SEQ, run=RUN)
    holder = MemoryStore(memory_root(nodes[1]), key, rank=1, world_size=2, asynchronous=False)
    holder.save(state, step=STEP, seq=SEQ, run=RUN)  # node 1's own rank, at the same save
    replica = install_replica(holder, owner.path, 0)
    owner.free()
    shutil.rmtree(nodes[0])  # node 0 is lost: its memory dir with it
    io = SafetensorsCheckpointIO()
    durable = os.path.join(durable_dir, f"step={DURABLE_STEP}.ckpt")
    io.save_checkpoint(state, durable)
    if s3_url is not None:
        io.save_checkpoint(state, s3_url)
    return {"nodes": nodes, "key": key, "replica": replica, "durable": durable, "s3": s3_url, "nbytes": nbytes,
            "size_mb": size_mb}  # fmt: skip


def install_replica(holder: MemoryStore, source: str, owner: int) -> str:
    """Put the exact bytes of ``owner``'s snapshot file into the holder's slot as its replica of it."""
    nbytes = os.path.getsize(source)
    with open(source, "rb") as f:
        chunks = (memoryview(f.read(CHUNK)) for _ in range(0, nbytes, CHUNK))
        return holder.write_received(replica_name(owner, holder.world_size), nbytes, chunks)


def recovery_worker(
    rank: int, port: int, spec: Dict[str, Any], repeats: int, s3_repeats: int
) -> Optional[Dict[str, List[float]]]:
    """Rank 0 (the replaced node) recovers from each source in turn; rank 1 (the peer) serves the replica."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = transport.transfer_group()
    bare = dist.new_group(backend="gloo")
    store = MemoryStore(memory_root(spec["nodes"][rank]), spec["key"], rank=rank, world_size=2, asynchronous=False)
    remote = [S3, RAW_S3] if spec["s3"] else []
    times: Dict[str, List[float]] = {name: [] for name in [REPLICA, BARE, COLD, WARM, *remote]}
    times.update({OFFERS: [], CARRY_OUT: [], LOAD: []})
    module = FlatModule(spec["size_mb"])  # the module the restore reads into, as a relaunched process builds it
    for r in range(repeats):
        sources = [REPLICA, BARE, COLD, WARM] + (remote if r < s3_repeats else [])
        order = sources[r % len(sources) :] + sources[: r % len(sources)]
        if WARM in order and COLD in order and order.index(WARM) < order.index(COLD):
            order.remove(WARM)
            order.insert(order.index(COLD) + 1, WARM)  # warm right after cold: the pages it read
        for source in order:
            dist.barrier()
            measured = recover_once(source, rank, store, spec, group, bare, module)
            for name, seconds in measured.items():
                times[name].append(seconds)
    dist.barrier()
    store.free()
    dist.destroy_process_group()
    return times if rank == 0 else None


def recover_once(
    source: str, rank: int, store: MemoryStore, spec: Dict[str, Any], group, bare, module: torch.nn.Module
) -> Dict[str, float]:
    """One recovery from ``source``: on rank 0 the seconds (and phases), on rank 1 its part of the transfer."""
    if source == REPLICA:
        measured = recover_from_peers(store, group, module, spec["copy"])
        return measured if rank == 0 else {}
    if source == BARE:
        if rank == 1:
            bare_send(spec["replica"], 0, bare)
            return {}
        return {BARE: bare_recv_timed(spec["nodes"][0], bare)}
    if rank == 1:
        return {}
    if source == COLD:
        drop_cached(spec["durable"])
        return {COLD: timed_load(spec["durable"], module, spec["copy"])}
    if source == WARM:
        return {WARM: timed_load(spec["durable"], module, spec["copy"])}
    if source == S3:
        return {S3: timed_load(spec["s3"], module, spec["copy"])}
    return {RAW_S3: raw_get(spec["s3"])}


class FlatModule(torch.nn.Module):
    """A module whose state dict is ``flat_state(size_mb)``'s: ``layer<i>.weight``, initialised (its pages touched,
    as a built model's are)."""

    def __init__(self, size_mb: int) -> None:
        super().__init__()
        for name, t in flat_state_shapes(size_mb).items():
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(torch.full(t, 0.5), requires_grad=False)
            setattr(self, name.split(".")[0], layer)


def flat_state_shapes(size_mb: int) -> Dict[str, Tuple[int, ...]]:
    n = size_mb * (1 << 20) // 4 // 8  # as flat_state
    return {f"layer{i}.weight": (n,) for i in range(8)}


def into_module(module: torch.nn.Module, state_dict: Dict[str, torch.Tensor]) -> None:
    """What Lightning's restore does with tensors a load did not read in place: copy each into the module's
    (``load_state_dict``; a tensor that is the module's own memory is not copied)."""
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if t.data_ptr() != state_dict[name].data_ptr():
                t.copy_(state_dict[name])


def recover_from_peers(store: MemoryStore, group, module: torch.nn.Module, copy: bool) -> Dict[str, float]:
    """Both ranks, as ``MemoryTier.choose`` recovers: each offers what its memory holds, verified
    (``memory.peers.offer``: each file checked a chunk at a time, no tensor kept); the offers are gathered and
    planned (``memory.recover.plan_recovery``); the plan is carried out (``memory.peers.carry_out``: the holder
    streams the replica, the owner installs it as its own snapshot, every digest checked as it arrives); then
    each rank reads its state once, unhashed, from the descriptor it was checked through, its weights straight
    into ``module`` (``MemoryStore.load(into=...)``; with ``copy``, into new memory and then copied, as before
    in-place loads). Times on rank 0, until the module holds the state."""
    started = time.perf_counter()
    owners = [o for o in store.replica_owners() if o != store.rank]
    mine, offered = peers.offer(store, RUN, owners, DURABLE_STEP)
    offers = collective.gather(offered)
    plan = plan_recovery(offers, 2, max(o.durable_step for o in offers))
    planned = time.perf_counter()
    assert isinstance(plan, RecoveryPlan) and plan.transfers == ((1, 0),), plan
    snapshot, problems = peers.carry_out(plan, store, group, RUN, mine)
    carried = time.perf_counter()
    assert not problems and snapshot is not None and (snapshot.step, snapshot.seq) == (STEP, SEQ), problems
    loaded = store.load(RUN, into=None if copy else destinations(module))
    assert loaded is not None and (loaded.step, loaded.seq) == (STEP, SEQ)
    into_module(module, loaded.checkpoint["state_dict"])
    done = time.perf_counter()
    del snapshot, mine, loaded
    if store.rank == 0:
        store.free()  # the next repeat receives it again
    return {REPLICA: done - started, OFFERS: planned - started, CARRY_OUT: carried - planned, LOAD: done - carried}


def timed_load(path: str, module: torch.nn.Module, copy: bool) -> float:
    """A durable restore's load: ``SafetensorsCheckpointIO`` reading the weights into ``module`` as a resume offers
    it (``load_into``; with ``copy``, into new memory and then copied)."""
    started = time.perf_counter()
    io = SafetensorsCheckpointIO()
    io.load_into(None if copy else module)
    checkpoint = io.load_checkpoint(path)
    into_module(module, checkpoint["state_dict"])
    seconds = time.perf_counter() - started
    assert checkpoint["global_step"] == 1
    return seconds


def raw_get(url: str) -> float:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    started = time.perf_counter()
    data = fs.cat_file(url)
    seconds = time.perf_counter() - started
    assert len(data) > 0
    return seconds


def drop_cached(path: str) -> None:
    """Evict ``path``'s pages from the page cache (clean pages: the save fsync'd them), this file only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------- the transfer: the product's (memory.transport) and bare


def bare_send(path: str, dst: int, group) -> int:
    """The file's size, then its bytes in ``CHUNK`` pieces straight from the page cache (mmap), over ``group``."""
    nbytes = os.path.getsize(path)
    dist.send(torch.tensor([nbytes], dtype=torch.int64), dst, group=group)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        for start in range(0, nbytes, CHUNK):
            piece = torch.frombuffer(view, dtype=torch.uint8, count=min(CHUNK, nbytes - start), offset=start)
            dist.send(piece, dst, group=group)
            del piece
    return nbytes


def bare_recv(src: int, group, out_path: str) -> int:
    """What :func:`bare_send` sends, written into ``out_path`` through one reused chunk buffer."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    nbytes, buffer = int(size.item()), torch.empty(CHUNK, dtype=torch.uint8)
    with open(out_path, "wb") as out:
        for start in range(0, nbytes, CHUNK):
            n = min(CHUNK, nbytes - start)
            dist.recv(buffer[:n], src, group=group)
            out.write(memoryview(buffer.numpy())[:n])
    return nbytes


def bare_recv_timed(node_dir: str, group) -> float:
    out = os.path.join(node_dir, "bare.bin")
    started = time.perf_counter()
    bare_recv(1, group, out)
    seconds = time.perf_counter() - started
    os.unlink(out)
    return seconds


def bare_exchange(path: str, out_path: str, peer: int, group) -> None:
    """Both ranks at once: send this rank's file to ``peer`` and write the peer's into ``out_path`` (chunk by
    chunk, ``isend``/``irecv`` paired), as a 2-node ring replicates each snapshot both ways."""
    mine = torch.tensor([os.path.getsize(path)], dtype=torch.int64)
    theirs = torch.zeros(1, dtype=torch.int64)
    for work in (dist.isend(mine, peer, group=group), dist.irecv(theirs, peer, group=group)):
        work.wait()
    sending, receiving, buffer = int(mine.item()), int(theirs.item()), torch.empty(CHUNK, dtype=torch.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view, open(out_path, "wb") as out:
        for start in range(0, max(sending, receiving), CHUNK):
            works, n_in = [], max(0, min(CHUNK, receiving - start))
            if start < sending:
                piece = torch.frombuffer(view, dtype=torch.uint8, count=min(CHUNK, sending - start), offset=start)
                works.append(dist.isend(piece, peer, group=group))
            if n_in:
                works.append(dist.irecv(buffer[:n_in], peer, group=group))
            for work in works:
                work.wait()
            if n_in:
                out.write(memoryview(buffer.numpy())[:n_in])
            works, piece = [], None


# ------------------------------------------------------------------------------------------------------ step time


class BareExchange(Callback):
    """This machine's limit beside the fit: at the end of the steps halfway between snapshots, a thread sends this
    rank's newest snapshot file to the other node over a gloo group of its own and writes the other's into
    tmpfs (:func:`bare_exchange`): the replica's bytes moved both ways with no format, digest or bookkeeping.
    ``spans``: each exchange's (start, end), ``time.perf_counter``."""

    def __init__(self, every: int, out_dir: str) -> None:
        self.every, self.out_dir = every, out_dir
        self.group = None
        self.thread: Optional[threading.Thread] = None
        self.spans: List[List[float]] = []

    def setup(self, trainer, pl_module, stage) -> None:
        self.group = dist.new_group(backend="gloo")  # every rank, in the same order: collective

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        memory = _memory(trainer)
        if trainer.global_step % self.every != self.every // 2 or memory is None or memory.store is None:
            return
        if self.thread is not None:
            self.thread.join()
        ready: List[Any] = [None, None]
        dist.all_gather_object(ready, os.path.exists(memory.store.path))  # both ranks start it, or neither
        if not all(ready):
            return  # before the first snapshot
        out = os.path.join(self.out_dir, f"bare-{trainer.global_rank}.bin")
        self.thread = threading.Thread(target=self._run, args=(memory.store.path, out, 1 - trainer.global_rank))
        self.thread.start()

    def _run(self, path: str, out: str, peer: int) -> None:
        started = time.perf_counter()
        bare_exchange(path, out, peer, self.group)
        self.spans.append([started, time.perf_counter()])

    def teardown(self, trainer, pl_module, stage) -> None:
        if self.thread is not None:
            self.thread.join()


class TransferLog:
    """The (start, end) of every replica transfer of this rank, sent or received: ``memory.transport``'s
    ``send_file`` and ``recv_file`` wrapped wherever the package bound them (a receive from the moment its
    header arrived: the sink's call, not the wait for it)."""

    def __init__(self) -> None:
        self.spans: List[List[Any]] = []  # start, end, "send" or "recv"

    def install(self) -> bool:
        try:
            from lightning_resume.memory import transport
        except ImportError:
            return False
        with contextlib.suppress(ImportError):
            importlib.import_module("lightning_resume.memory.replicate")
        send, recv = transport.send_file, transport.recv_file

        def timed_send(*args, **kwargs):
            started = time.perf_counter()
            try:
                return send(*args, **kwargs)
            finally:
                self.spans.append([started, time.perf_counter(), "send"])

        def timed_recv(src, group, sink, *args, **kwargs):
            def timed_sink(nbytes, chunks):
                started = time.perf_counter()
                try:
                    return sink(nbytes, chunks)
                finally:
                    self.spans.append([started, time.perf_counter(), "recv"])

            return recv(src, group, timed_sink, *args, **kwargs)

        for name, module in list(sys.modules.items()):
            if name.startswith("lightning_resume.") and module is not None:
                for attr, original, wrapped in (("send_file", send, timed_send), ("recv_file", recv, timed_recv)):
                    if getattr(module, attr, None) is original:
                        setattr(module, attr, wrapped)
        return True


def _memory(trainer: pl.Trainer):
    exact = next((c for c in trainer.callbacks if isinstance(c, ExactResume)), None)  # type: ignore[attr-defined]
    return None if exact is None else exact.memory


def local_write_in_flight(memory) -> bool:
    saver = getattr(memory.store, "_saver", None) if memory is not None and memory.store is not None else None
    return saver is not None and saver.in_flight()


class StepClock(Callback):
    """Every batch start's time, whether the memory tier's own write was in flight then, and the batches whose end
    took a memory snapshot."""

    def __init__(self) -> None:
        self.starts: List[float] = []
        self.local: List[bool] = []
        self.snapshots: List[int] = []
        self._seq = 0

    def on_train_batch_start(self, trainer, *args) -> None:
        memory = _memory(trainer)
        if memory is not None and memory.seq != self._seq:  # the previous batch's end took a snapshot
            self._seq = memory.seq
            self.snapshots.append(len(self.starts) - 1)
        self.starts.append(time.perf_counter())
        self.local.append(local_write_in_flight(memory))


def fit_worker(node: int, work: str, params_mb: float, steps: int, every: int, replicas: int) -> Dict[str, Any]:
    """One node's rank of the 2-node fit (``NODE_RANK``, ``MASTER_PORT`` set by the parent)."""
    durable = os.path.join(work, "durable")
    memory_dir = os.path.join(work, f"node{node}")
    bare, clock, log = BareExchange(every, memory_dir), StepClock(), TransferLog()
    instrumented = log.install()
    options = MemoryTierOptions(dir=memory_dir, every_n_train_steps_max=every, replicas=replicas)
    exact = ExactResume(mtbf=None, preemption=None, memory_tier=options)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", max_steps=steps,
        callbacks=[exact, ModelCheckpoint(dirpath=durable, every_n_train_steps=10 * steps), bare, clock],
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=work, use_distributed_sampler=True,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(Wide(params_mb, width=1024, samples=2 * 8 * (steps + 1)))  # one epoch: no epoch end among the steps
    replicator = getattr(exact.memory, "replicator", None)
    last = getattr(replicator, "last_transfer", None)
    return {
        "starts": clock.starts,
        "local": clock.local,
        "snapshots": clock.snapshots,
        "bare": bare.spans,
        "replica": log.spans,
        "instrumented": instrumented,
        "replicator": replicator is not None,
        "last_transfer": None if last is None else {"nbytes": last.nbytes, "seconds": last.seconds},
        "state_mb": sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values()) * 3 / 2**20,
    }


KINDS = ("calm", "snapshot step", "replica in flight", "local write only", "bare in flight (limit)")


def classify(run: Dict[str, Any]) -> tuple[Dict[str, List[float]], Dict[str, int]]:
    """Each step (one batch start to the next) by what ran beside it, and the transfers (rounds) counted. Steps
    before the second snapshot (the first snapshot and transfer of each kind: buffers new) and the steps beside
    both kinds of transfer at once are left out."""
    starts = run["starts"]
    steps = [(a, b) for a, b in zip(starts, starts[1:])]
    warmup = run["snapshots"][1] if len(run["snapshots"]) > 1 else len(steps)
    since = starts[min(warmup, len(starts) - 1)]
    replica = [(s, e) for s, e, _ in run["replica"]]
    bare = [(s, e) for s, e in run["bare"]]
    rounds = {
        "replica in flight": sum(1 for s, _, kind in run["replica"] if kind == "send" and s >= since),
        "bare in flight (limit)": sum(1 for s, _ in bare if s >= since),
    }
    kinds: Dict[str, List[float]] = {name: [] for name in KINDS}
    for i, (a, b) in enumerate(steps):
        beside = lambda spans: any(s < b and e > a for s, e in spans)
        if i < warmup or (beside(replica) and beside(bare)):
            continue
        if i in run["snapshots"]:
            kind = "snapshot step"
        elif beside(replica):
            kind = "replica in flight"
        elif beside(bare):
            kind = "bare in flight (limit)"
        elif run["local"][i] or (i + 1 < len(run["local"]) and run["local"][i + 1]):
            kind = "local write only"
        else:
            kind = "calm"
        kinds[kind].append(b - a)
    return kinds, rounds


def analyse_steps(run: Dict[str, Any]) -> Dict[str, Any]:
    """Each kind of step over the calm step's median; for the transfers, the time lost per transfer (the sum over
    the steps beside them of step - calm, over the transfers) in calm steps."""
    kinds, rounds = classify(run)
    calm = statistics.median(kinds["calm"]) if kinds["calm"] else float("nan")
    out: Dict[str, Any] = {"calm_s": calm}
    for name, v in kinds.items():
        row = {"n": len(v), "ratio": _med(v) / calm if v else None, "mean": _mean(v) / calm if v else None}
        if rounds.get(name):
            row["rounds"] = rounds[name]
            row["lost"] = sum(t - calm for t in v) / rounds[name] / calm
        out[name] = row
    return out


def _mean(values: List[float]) -> float:
    return sum(values) / len(values)


# ------------------------------------------------------------------------------------------------------- parent


def run_recovery(args: argparse.Namespace) -> Tuple[Dict[str, List[float]], float]:
    work = tempfile.mkdtemp(prefix="bench-replica-", dir=args.shm_dir)
    disk = tempfile.mkdtemp(prefix="bench-replica-", dir=args.disk_dir)
    server = start_s3(args)
    try:
        s3_url = None
        if server is not None:
            import fsspec

            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            fsspec.filesystem("s3").mkdir(bucket)
            s3_url = f"s3://{bucket}/step={DURABLE_STEP}.ckpt"
        spec = {**prepare_recovery(args.size_mb, work, disk, s3_url), "copy": args.copy}
        said = f"{args.repeats} repeats ({min(args.repeats, args.s3_repeats)} with S3)"
        print(f"recovery: a {spec['nbytes'] / 2**20:.0f} MiB snapshot, {said}, load {_load()}")
        results = spawn_pair(
            "recovery", json.dumps({"spec": spec, "repeats": args.repeats, "s3_repeats": args.s3_repeats}), args
        )
        return results[0], spec["nbytes"] / 2**20
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def start_s3(args: argparse.Namespace):
    """The moto server in this process (idle while the workers load), its endpoint in the environment; ``None``
    without moto/s3fs or with ``--no-s3``."""
    if args.no_s3:
        return None
    try:
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer
    except ImportError:
        print("S3 rows skipped: moto[server] and s3fs are not installed")
        return None
    import logging

    from tests.helpers.s3 import s3_env

    # CRITICAL: under load s3fs may retry a CompleteMultipartUpload that went through; moto answers the retry
    # with a KeyError traceback, though the object is whole (the save's commit checks it)
    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(s3_env(f"http://127.0.0.1:{port}"))
    return server


def run_steps(args: argparse.Namespace) -> Dict[str, Any]:
    work = tempfile.mkdtemp(prefix="bench-replica-fit-", dir=args.shm_dir)
    try:
        payload = {"params_mb": args.fit_params_mb, "steps": args.fit_steps, "every": args.every}
        payload["replicas"], payload["work"] = args.replicas, work
        print(f"step time: 2 nodes x 1 rank, {args.fit_steps} steps, snapshot every {args.every}, load {_load()}")
        results = spawn_pair("fit", json.dumps(payload), args)
        return results[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def spawn_pair(kind: str, payload: str, args: argparse.Namespace) -> List[Any]:
    """Rank/node 0 and 1 as two fresh processes on 127.0.0.1; their results (rank 0's first)."""
    port = free_port()
    env_base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": "0"}
    env_base["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    children = []
    for rank in range(2):
        env = {**env_base, "NODE_RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--rank", str(rank), "--port", str(port)]
        children.append(subprocess.Popen([*cmd, payload], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for rank, child in enumerate(children):
        out, err = child.communicate(timeout=args.timeout)
        line = next((x for x in out.decode().splitlines() if x.startswith("RESULT ")), None)
        if child.returncode != 0 or line is None:
            for other in children:
                other.kill()
            raise RuntimeError(f"{kind} worker {rank} failed ({child.returncode}):\n{err.decode()[-4000:]}")
        results.append(json.loads(line[len("RESULT ") :]))
    return results


def worker(args: argparse.Namespace) -> None:
    payload = json.loads(args.payload)
    if args.worker == "recovery":
        result: Any = recovery_worker(args.rank, args.port, payload["spec"], payload["repeats"], payload["s3_repeats"])
    else:
        result = fit_worker(
            args.rank, payload["work"], payload["params_mb"], payload["steps"], payload["every"], payload["replicas"]
        )
    print("RESULT " + json.dumps(result), flush=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _med(values: List[float]) -> float:
    return statistics.median(values)


def report_recovery(times: Dict[str, List[float]], nbytes_mb: float) -> Dict[str, float]:
    print(f"| recovery of {nbytes_mb:.0f} MiB, node 0 replaced | median s (min-max) | GB/s | replica faster by |")
    print("|---|---|---|---|")
    replica = _med(times[REPLICA])
    for name, values in times.items():
        if not values:
            continue
        m = _med(values)
        speedup = f"{m / replica:.2f}x" if name in (COLD, WARM, S3, RAW_S3, BARE) else ""
        print(f"| {name} | {m:.3f} ({min(values):.3f}-{max(values):.3f}) | {nbytes_mb / 1024 / m:.2f} | {speedup} |")
    return {name: _med(v) for name, v in times.items() if v}


def report_steps(run: Dict[str, Any], analysed: Dict[str, Any]) -> None:
    transfer = run["last_transfer"]
    said = "none" if transfer is None else f"{transfer['nbytes'] / 2**20:.0f} MiB in {transfer['seconds']:.2f} s"
    print(f"state ~{run['state_mb']:.0f} MB, replicator on: {run['replicator']}, {len(run['replica'])} transfers timed,"
          f" {len(run['bare'])} bare exchanges, last replica transfer: {said};")  # fmt: skip
    print(f"calm step {analysed['calm_s'] * 1000:.1f} ms (median), load {_load()}")
    print("| step (node 0) | n | median / calm | mean / calm | transfers | lost per transfer, in calm steps |")
    print("|---|---|---|---|---|---|")
    for name, row in analysed.items():
        if name == "calm_s":
            continue
        med = "-" if row["ratio"] is None else f"{row['ratio']:.3f}x"
        mean = "-" if row["mean"] is None else f"{row['mean']:.3f}x"
        lost = f"| {row['rounds']} | {row['lost']:.2f} |" if "lost" in row else "| | |"
        print(f"| {name} | {row['n']} | {med} | {mean} {lost}")


def verdict(recovery: Optional[Dict[str, float]], steps: Optional[Dict[str, Any]]) -> str:
    parts = []
    if recovery is not None:
        replica = recovery[REPLICA]
        if S3 in recovery:
            s3 = recovery[S3] / replica
            parts.append(f"replica {s3:.1f}x faster than S3 (goal >= 5x: {'met' if s3 >= 5 else 'NOT met'})")
        for name in (COLD, WARM):
            ratio = replica / recovery[name]
            parts.append(f"replica / {name} {ratio:.2f}x (goal <= 1: {'met' if ratio <= 1 else 'NOT met'})")
    if steps is not None:
        ours, limit = steps["replica in flight"]["ratio"], steps["bare in flight (limit)"]["ratio"]
        if ours is None:
            parts.append("no step ran with a replica in flight")
        else:
            met = ours <= 1.03 or (limit is not None and ours <= limit)
            lim = "-" if limit is None else f"{limit:.3f}x"
            parts.append(f"step with a replica in flight {ours:.3f}x calm, limit {lim} (goal <= 1.03x or <= limit:"
                         f" {'met' if met else 'NOT met'})")  # fmt: skip
    return "VERDICT: " + "; ".join(parts)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="the recovered state (MB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fit-params-mb", type=float, default=100, help="the fit's fp32 weights (state ~3x)")
    parser.add_argument("--fit-steps", type=int, default=121)
    parser.add_argument("--every", type=int, default=20, help="a memory snapshot every this many steps")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--only", choices=("recovery", "steps"), default=None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that the benchmark runs")
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument(
        "--copy", action="store_true", help="recover into new memory, then copy into the module (before in-place)"
    )
    parser.add_argument(
        "--s3-repeats", type=int, default=1, help="repeats that also load from S3 (moto serves ~1 GB in minutes)"
    )
    parser.add_argument("--shm-dir", default="/dev/shm", help="where the nodes' memory dirs go (a tmpfs)")
    parser.add_argument("--disk-dir", default=None, help="where the durable file goes (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", choices=("recovery", "fit"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("payload", nargs="?", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.size_mb, args.repeats, args.fit_params_mb, args.fit_steps, args.every = 8, 1, 4, 33, 8
    return args


def main() -> None:
    args = parse()
    if args.worker is not None:
        worker(args)
        return
    recovery = steps = None
    if args.only in (None, "recovery"):
        times, size = run_recovery(args)
        recovery = report_recovery(times, size)
    if args.only in (None, "steps"):
        run = run_steps(args)
        steps = analyse_steps(run)
        report_steps(run, steps)
    print(verdict(recovery, steps))


if __name__ == "__main__":
    main()
