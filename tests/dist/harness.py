"""Run a function on N gloo ranks (one process each) and collect what each rank returns."""

from __future__ import annotations

import io
import os
import time
import traceback
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncpp.parallel.failfast import abort_process_groups

FAIL_FAST_GRACE_S = 15.0
"""Once a rank reports an error, how long the others get to report theirs before they are killed (unless the test
expects a rank to die): a failed rank aborts its process groups (as asyncpp/parallel/failfast.py does in a run), so
a peer blocked in a collective with it sees the broken link within a second or two; one blocked elsewhere would
otherwise hold the test until its timeout."""


def rendezvous_store(world_size: int) -> dist.TCPStore:
    """The ranks' rendezvous, hosted by the parent on a port the OS picks and held until every rank is done. A
    port found free by binding and closing a socket could be taken by another process (another test session on
    the machine) before rank 0 bound it again: a case of the matrix once failed so at rendezvous (TCPStore
    connection reset). The ranks join it as torchrun's workers join their agent's store
    (TORCHELASTIC_USE_AGENT_STORE: every rank a client)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)


PRELOAD = ("torch", "torch.distributed", "asyncpp.job", "asyncpp.pipeline.compose", "asyncpp.reference.executor",
           "model_zoo", "tests.dist.harness", "tests.dist.workers", "tests.dist.tp_workers", "tests.dist.ep_workers",
           "tests.dist.muon_workers", "tests.dist.megatron_core_workers", "tests.dist.megatron_vocab_workers",
           "tests.dist.megatron_checkpoint_workers")
"""What the fork server imports once, so that a rank starts as a fork of it instead of a fresh interpreter that
imports torch and asyncpp again: 6-7 s of imports per rank on this 2-core machine, paid by every rank of every
multi-process test under the spawn start method, were most of the default suite's time (tests/dist: 130 tests,
933 s). Nothing here runs a kernel or starts a thread before the fork (torch's intra-op pool starts lazily), so a
forked rank begins in the state a freshly spawned one reaches after its imports."""


def _context():
    """The fork server's context: a clean process (not a fork of pytest, which holds threads and state), started
    once per test session and kept; each rank is a fork of it."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts (the first rank), then ignored
    return ctx


def _pack(fn, args: tuple) -> bytes:
    """fn and its arguments as bytes: tensors travel by value. Passed as objects, torch.multiprocessing's pickler
    would hand each tensor's storage to the rank as a file descriptor, and the fork server takes at most ~250 per
    process (a state dict of a model exceeds that: 'too many fds')."""
    buf = io.BytesIO()
    torch.save((fn, args), buf)
    return buf.getvalue()


def _entry(rank: int, world_size: int, port: int, packed: bytes, queue, environ: dict) -> None:
    # The fork server's environment is the parent's when the server started; a spawned rank would see the
    # parent's now (a test may have set a variable since).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True",
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # N processes share 2 cores: oversubscribed OpenMP threads spin for seconds
    try:
        fn, args = torch.load(io.BytesIO(packed), weights_only=False)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # bytes, not tensors: tensors would travel as shared-memory handles that die with this process
        buf = io.BytesIO()
        torch.save(fn(rank, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - re-raised in the parent with the rank's traceback
        queue.put((rank, "error", traceback.format_exc()))
        # As a failed rank of a run (asyncpp/parallel/failfast.py): abort, flush the report, leave at once. Neither
        # destroy_process_group nor the interpreter's teardown: both wait on work in flight with peers that may be
        # waiting on us; os._exit closes this rank's links, so its peers fail on them at once.
        abort_process_groups()
        queue.close()
        queue.join_thread()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, expect_dead: bool = False,
              grace: float = FAIL_FAST_GRACE_S) -> list:
    """fn(rank, *args) on every rank; returns [result of rank 0, ...]. fn must be importable (pickled).

    A rank that exits without reporting counts as an error, or, with expect_dead=True, yields
    ("died", exitcode) in its slot so a test can check how the survivors reacted. Without expect_dead, the first
    error ends the wait `grace` seconds later: the ranks that have not reported by then are killed.
    """
    ctx = _context()
    queue = ctx.Queue()
    store = rendezvous_store(world_size)
    environ, packed = dict(os.environ), _pack(fn, args)
    procs = [ctx.Process(target=_entry, args=(r, world_size, store.port, packed, queue, environ))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors, deadline = {}, [], time.monotonic() + timeout
    try:
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=0.5)
            except Empty:
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode is not None and queue.empty():
                        results[r] = ("died", p.exitcode)
                continue
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                if not expect_dead:
                    deadline = min(deadline, time.monotonic() + grace)
            results[rank] = value if status == "error" else torch.load(io.BytesIO(value), weights_only=False)
    finally:
        failed = bool(errors) and not expect_dead  # whoever has not exited by now is stuck: no grace twice
        for p in procs:
            p.join(timeout=0.5 if failed else 10)
            if p.is_alive():
                p.kill()
    missing = [r for r in range(world_size) if r not in results]
    if missing and errors and not expect_dead:
        errors.append(f"ranks {missing} had not reported {grace:g} s after the first error: killed")
    elif missing:
        raise TimeoutError(f"ranks {missing} neither reported nor exited within {timeout}s")
    died = [r for r, v in results.items() if isinstance(v, tuple) and v[:1] == ("died",)]
    if died and not expect_dead:
        errors.append(f"ranks {died} died without reporting")
    if errors and not expect_dead:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
