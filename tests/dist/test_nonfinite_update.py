"""A non-finite update on one stage stops every rank at the same step with NonFiniteUpdate (no rank is left
waiting, no checkpoint of the bad state), and the stage that produced it kept x_t."""

from __future__ import annotations

import pytest

from tests.dist.harness import run_ranks
from tests.dist.workers import make_config, pipeline_rank

pytestmark = pytest.mark.dist


def overflowing_rank(rank: int, cfg_dict: dict, victim: int, bad_call: int) -> dict:
    """The victim's optimizer step number `bad_call` (0-based) produces a NaN weight (an overflowing update)."""
    import torch

    from asyncpp.core.update import UpdateRule

    original, calls = UpdateRule._step, []

    def step(self, *args):
        original(self, *args)
        if rank == victim and len(calls) == bad_call:
            with torch.no_grad():
                self.masters[0].view(-1)[0] = float("nan")
        calls.append(1)

    UpdateRule._step = step
    try:
        return pipeline_rank(rank, cfg_dict)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return {"error": f"{type(e).__name__}: {e}"}


@pytest.mark.parametrize("victim", [0, 1])
def test_a_non_finite_update_on_one_stage_stops_every_rank_at_the_same_step(tmp_path, victim):
    cfg = make_config(parallel={"pp": 2}, train={"steps": 8},
                      checkpoint={"enabled": True, "every": 0, "dir": str(tmp_path / "ckpt")})
    results = run_ranks(overflowing_rank, 2, cfg.to_dict(), victim, 2)
    for res in results:
        assert res.get("error", "").startswith("NonFiniteUpdate: step 2: the update was not finite on at least one "
                                               "stage"), res.get("error", res.keys())
    assert not list((tmp_path / "ckpt").glob("step_*"))  # nothing saved after the bad step
