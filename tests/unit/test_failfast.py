"""asyncpp/parallel/failfast.py on a one-rank gloo group: the first failure is published once in the job's store,
a later one says it follows it, a rank that only saw a peer's checkpoint write fail defers to that rank, and the
process groups are gone afterwards (aborted, nothing waited for)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from asyncpp.parallel import failfast
from asyncpp.pipeline.p2p import PipelineTimeout
from asyncpp.train.checkpoint.saver import SaveFailedOnRanks


@pytest.fixture
def store():
    return dist.HashStore()


def raised(error: BaseException) -> BaseException:
    """`error` with a traceback, as the training loop hands it over."""
    try:
        raise error
    except BaseException as e:  # noqa: BLE001 - returned to the test
        return e


def group_on(store):
    """A one-rank job on `store`; returns the store as the group sees it (under torch's prefix)."""
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    dist.new_group([0])  # a second group: abandon aborts every one
    return c10d._get_default_store()


def test_the_first_failure_is_published_and_a_later_one_follows_it(store):
    job_store = group_on(store)
    first = failfast.abandon(raised(RuntimeError("bad tensor\nmore")), 0, 5, "F5.0@v4 (stage 0, microbatch 0, forward)")
    assert not dist.is_initialized()  # aborted: the default group and the other one
    assert first.first and "Traceback" in first.trace and "RuntimeError: bad tensor" in first.trace
    assert str(first).startswith("rank 0 failed at step 5 in action F5.0@v4 (stage 0, microbatch 0, forward): "
                                 "RuntimeError: bad tensor. The other ranks stop now")
    assert job_store.get(failfast.STORE_KEY).decode().startswith("rank 0 failed at step 5")

    group_on(store)  # another rank of the same job, whose link broke afterwards
    later = failfast.abandon(ConnectionError("Connection closed by peer"), 0, 5, "")
    assert not later.first and not later.trace
    assert str(later).startswith("rank 0 stops: it follows the job's first failure (rank 0 failed at step 5 in "
                                 "action F5.0@v4")
    assert "its own error: ConnectionError: Connection closed by peer" in str(later)


def test_a_rank_that_saw_a_peers_checkpoint_write_fail_defers_to_that_rank(store):
    job_store = group_on(store)
    cause = SaveFailedOnRanks("writing checkpoint c/step_00000006 failed on rank(s) [1]: rank 1: RuntimeError: disk "
                              "controller", (1,))
    seen = PipelineTimeout("stage 0 (rank 0) gave up waiting for every rank's part of the checkpoint of step 6")
    seen.__cause__ = cause
    failed = failfast.abandon(seen, 0, 6, "the checkpoint of step 6")
    assert not failed.first and "follows the job's first failure (rank(s) [1]: writing checkpoint" in str(failed)
    assert not job_store.check([failfast.STORE_KEY])  # rank 1 publishes it, not this rank


def test_without_a_process_group_it_still_reports(store):
    failed = failfast.abandon(RuntimeError("before the group"), 3, None, "the start-up (building the stage)")
    assert failed.first and str(failed).startswith("rank 3 failed in action the start-up (building the stage): "
                                                   "RuntimeError: before the group")
