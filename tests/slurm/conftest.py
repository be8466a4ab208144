"""The real-slurm tier: a two-node cluster on this machine (launch/testing/cluster.py), started once per session
and torn down after it. `make test-slurm` runs it (root, `ip netns`, Debian's slurm-wlm; the cluster installs
the packages when they are missing)."""

from __future__ import annotations

import os
import shutil

import pytest

from launch.testing.cluster import Cluster


@pytest.fixture(scope="session")
def cluster():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("the slurm tier needs root and iproute2 (network namespaces): run `make test-slurm` as root")
    c = Cluster().up()
    try:
        yield c
    finally:
        c.down()
