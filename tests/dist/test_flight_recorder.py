"""Issue 31: on a hang every rank that gives up leaves evidence. One rank stops answering before a collective or
before a pipeline send; the other gives up within its timeout, its error names a file in the dump directory, and
that file (asyncpp/parallel/flight.py) lists the op it waited for as pending, with the peer, the shape and what the
project calls it, after the ops that did complete."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from asyncpp.parallel import collectives, flight
from asyncpp.parallel.collectives import CollectiveTimeout, bound_group
from asyncpp.pipeline.p2p import StageComm
from tests.dist.harness import run_ranks
from tests.dist.workers import make_config, pipeline_rank

pytestmark = pytest.mark.dist

FILE = re.compile(r"This rank's recent communication ops are in (\S+\.json)\.")


def _evidence(message: str, dump_dir: str) -> dict:
    """The file the message names (it must be in dump_dir) and its contents."""
    m = FILE.search(message)
    assert m, message
    path = Path(m.group(1))
    assert path.parent == Path(dump_dir) and path.is_file(), (path, sorted(Path(dump_dir).iterdir()))
    return json.loads(path.read_text())


def silent_before_all_reduce(rank: int, dump_dir: str, timeout_s: float) -> dict:
    """Two all-reduces on a bounded group; rank 1 sleeps past the timeout before the second, then exits."""
    group = dist.new_group([0, 1])
    bound_group(group, where=f"stage 0 (rank {rank})", name="the test's group (ranks [0, 1])", timeout_s=timeout_s)
    with flight.recording(dump_dir=dump_dir):
        collectives._all_reduce(torch.ones(3, 5), group, "the first all-reduce")
        if rank == 1:
            time.sleep(timeout_s + 4)
            os._exit(17)
        try:
            collectives._all_reduce(torch.ones(3, 5), group, "the second all-reduce")
        except CollectiveTimeout as e:
            return {"error": str(e)}
    return {"error": None}


@pytest.mark.slow  # the default suite's 12-minute budget (2026-11-26); a smaller case of the same mechanism stays default
def test_a_collective_timeout_writes_the_pending_all_reduce_and_names_the_file(tmp_path):
    results = run_ranks(silent_before_all_reduce, 2, str(tmp_path), 3.0, timeout=60, expect_dead=True)
    assert results[1] == ("died", 17)
    message = results[0]["error"]
    assert message is not None and message.startswith("stage 0 (rank 0) gave up waiting for the second all-reduce")
    body = _evidence(message, str(tmp_path))
    assert body["rank"] == 0 and body["where"] == "stage 0 (rank 0)" and body["reason"] in message
    ops = [e for e in body["entries"] if "wait" not in e]
    assert [(o["name"], o["what"], o["state"]) for o in ops] == [
        ("all_reduce", "the first all-reduce", "completed"), ("all_reduce", "the second all-reduce", "failed")]
    assert ops[1]["shape"] == [3, 5] and ops[1]["dtype"] == "float32" and ops[1]["ranks"] == [0, 1]
    (pending,) = body["pending"]  # the operator's line: the op, its group by the job's name for it, its state
    assert pending.startswith("#1 all_reduce([3, 5] float32) on the test's group (ranks [0, 1]): failed after "
                              "waiting 3."), pending
    assert "the second all-reduce" in pending and "test_flight_recorder.py:silent_before_all_reduce" in pending


def pipeline_with_a_silent_sender(rank: int, cfg_dict: dict, dump_dir: str, victim_sends: int, sleep_s: float):
    """A 2-stage pipeline whose stage 0 sleeps before its `victim_sends`-th activation send, then exits; stage 1
    reports the error it raised."""
    original, calls = StageComm.send_forward, []

    def silent(self, output, step=None, free_after=True):  # StageComm.send_forward's signature
        if len(calls) == victim_sends:
            time.sleep(sleep_s)
            os._exit(17)
        calls.append(step)
        return original(self, output, step, free_after)

    StageComm.send_forward = silent
    with flight.recording(dump_dir=dump_dir):
        try:
            pipeline_rank(rank, cfg_dict)
        except CollectiveTimeout as e:
            return {"error": str(e), "sent": calls}
    return {"error": None}


@pytest.mark.slow  # re-tiered (session 8): the default suite's budget; 18 s; the collective-timeout test above keeps the recorder in the
# default tier
def test_a_pipeline_hang_leaves_the_waiting_stage_s_receive_in_its_file(tmp_path):
    timeout_s = 10.0
    cfg = make_config(parallel={"pp": 2}, schedule={"name": "2bw"},
                      train={"steps": 4, "num_microbatches": 2, "timeout_s": timeout_s})
    results = run_ranks(pipeline_with_a_silent_sender, 2, cfg.to_dict(), str(tmp_path), 5, timeout_s + 4,
                        timeout=180, expect_dead=True)
    assert results[0] == ("died", 17)
    message = results[1]["error"]
    assert message is not None and message.startswith("stage 1 (rank 1) gave up waiting for the input activation of "
                                                      "F"), message
    waited = message.split("gave up waiting for ")[1].split(" (train.timeout_s")[0]  # "... of F2.1@v2 from rank 0"
    body = _evidence(message, str(tmp_path))
    assert body["rank"] == 1 and body["where"] == "stage 1 (rank 1)"
    ops = [e for e in body["entries"] if "wait" not in e]
    failed = [o for o in ops if o["state"] == "failed"]
    assert len(failed) == 1, failed
    (hung,) = failed
    assert hung["name"] == "irecv" and hung["waited_as"] == waited, hung
    assert hung["parts"] == [{"kind": "recv", "peer": 0, "shape": hung["parts"][0]["shape"], "dtype": "float32"}]
    assert hung["parts"][0]["shape"][0] == cfg.train.micro_batch_size
    # Stage 0's five activations came in before: five receives from rank 0 completed, each named by its action.
    received = [o for o in ops if o["name"] == "irecv" and o["parts"][0]["peer"] == 0 and o["state"] == "completed"]
    assert len(received) == 5 and all(o["waited_as"].startswith("the input activation of F") for o in received)
    assert all(o["issued"] <= hung["issued"] for o in received)
    first = body["pending"][0]  # what this rank gave up on comes first
    assert first.startswith(f"#{hung['seq']} irecv(recv from 0 ") and ": failed after waiting 1" in first, first
    assert waited in first and "p2p.py:_post" in first, first
