"""Shapes of the LR multipliers."""

from __future__ import annotations

from itertools import pairwise

import pytest

from asyncpp.optim.lr_schedule import lr_multiplier

T, W = 100, 10


def _curve(kind: str, **kw) -> list[float]:
    return [lr_multiplier(s, total_steps=T, warmup_steps=W, kind=kind, **kw) for s in range(T + 1)]


@pytest.mark.parametrize("kind", ["constant", "cosine", "wsd"])
def test_warmup_is_linear_and_starts_above_zero(kind: str) -> None:
    c = _curve(kind)
    assert c[0] == pytest.approx(1 / W)
    assert c[W - 1] == pytest.approx(1.0)
    for s in range(W):
        assert c[s] == pytest.approx((s + 1) / W)


def test_constant() -> None:
    assert all(v == 1.0 for v in _curve("constant")[W:])


def test_cosine_shape() -> None:
    c = _curve("cosine", min_lr_ratio=0.1)
    assert c[W] == pytest.approx(1.0)
    assert c[(W + T) // 2] == pytest.approx(0.55)  # midpoint of the decay: (1 + 0.1) / 2
    assert c[T] == pytest.approx(0.1)
    assert all(a >= b for a, b in pairwise(c[W:]))
    assert lr_multiplier(T + 50, total_steps=T, warmup_steps=W, kind="cosine") == pytest.approx(0.1)


def test_wsd_shape() -> None:
    c = _curve("wsd", min_lr_ratio=0.0, decay_fraction=0.2)
    assert all(v == 1.0 for v in c[W:80])  # stable until the last 20% of steps
    assert c[90] == pytest.approx(0.5)
    assert c[T] == pytest.approx(0.0)
    assert all(a > b for a, b in pairwise(c[80:]))


def test_wsd_decay_never_overlaps_warmup() -> None:
    c = [lr_multiplier(s, total_steps=20, warmup_steps=10, kind="wsd", decay_fraction=1.0) for s in range(21)]
    assert c[9] == pytest.approx(1.0) and c[10] == pytest.approx(1.0)
    assert c[20] == pytest.approx(0.1)
    assert all(a > b for a, b in pairwise(c[10:]))


def test_no_warmup_and_all_warmup() -> None:
    assert lr_multiplier(0, total_steps=T, warmup_steps=0, kind="cosine") == pytest.approx(1.0)
    assert lr_multiplier(T - 1, total_steps=T, warmup_steps=T, kind="cosine") == pytest.approx(1.0)
    assert lr_multiplier(T, total_steps=T, warmup_steps=T, kind="cosine") == pytest.approx(0.1)


def test_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"kind='linear'.*constant.*cosine.*wsd"):
        lr_multiplier(0, total_steps=T, warmup_steps=W, kind="linear")
    with pytest.raises(ValueError, match="warmup_steps=200"):
        lr_multiplier(0, total_steps=T, warmup_steps=200, kind="cosine")
    with pytest.raises(ValueError, match="step=-1"):
        lr_multiplier(-1, total_steps=T, warmup_steps=W, kind="cosine")
