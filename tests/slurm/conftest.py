"""The real-slurm tier: a two-node cluster on this machine (launch/testing/cluster.py). `make test-slurm` runs it
(root, `ip netns`, Debian's slurm packages; the cluster installs them when they are missing). A cluster that an
earlier `python -m launch.testing.cluster up` left running is used as it is, and left to whoever started it
(`make test-slurm-ci`, CI's two tests, starts one without accounting and stops it); otherwise the session starts
one with accounting and tears it down after the last test."""

from __future__ import annotations

import os
import shutil

import pytest

from launch.testing.cluster import Cluster


@pytest.fixture(scope="session")
def cluster():
    running = Cluster.running()
    if running is not None:
        yield running
        return
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("the slurm tier needs root and iproute2 (network namespaces): run `make test-slurm` as root")
    c = Cluster().up()
    try:
        yield c
    finally:
        c.down()
