"""parallel.head=vocab without processes: the head's mathematics shard by shard against the unsplit head, the
config's refusals (each naming the field, the value and the fix), and the schedule every rank derives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncpp.config import ConfigError
from asyncpp.core.partition import head_of, vocab_shards_of
from asyncpp.core.vocab_split import run_vocab_placement, run_vocab_split, vocab_pipeline, vocab_placement
from asyncpp.job import compose, resolve
from asyncpp.parallel.vocab_parallel import VocabShard, vocab_shards
from asyncpp.pipeline.vocab_head import logits_gradient, mean_loss, shard_statistics_
from asyncpp.schedules.actions import Op
from asyncpp.schedules.costmodel import VocabPlacement
from asyncpp.schedules.invariants import check_schedules
from asyncpp.train.preflight import check_vocab_placement


def check(overrides: list[str]):
    return resolve(compose(overrides))


@pytest.mark.parametrize("rows", [[2816, 5376], [0, 3000, 192, 5000], [8192, 0]])
def test_shard_math_equals_the_unsplit_cross_entropy(rows):
    """The loss from the gathered statistics equals F.cross_entropy's to fp32 rounding, and the shards' logits
    gradients are the rows of autograd's (to a few ulp: the sum of exponentials is taken in another order); an
    empty shard joins with (-inf, 0, 0) and changes nothing."""
    torch.manual_seed(0)
    n, h, vocab = 48, 32, sum(rows)
    x, w = torch.randn(n, h), torch.randn(vocab, h) * 0.5
    t = torch.randint(0, vocab, (n,))
    t[0], t[1] = 0, vocab - 1  # the first and the last row as targets
    logits = F.linear(x, w).requires_grad_()
    loss = F.cross_entropy(logits, t)
    loss.backward()
    shards = vocab_shards(rows, vocab)
    parts = [F.linear(x, w[s.start:s.end]) for s in shards]
    stats = [shard_statistics_(p, t, s) for p, s in zip(parts, shards)]  # parts now hold the exponentials
    top, total, mine = mean_loss(torch.cat(stats))
    u = 2.0 ** -24
    assert abs(float(mine) - float(loss.detach())) <= 8 * u * float(loss.detach())
    grad = torch.cat([logits_gradient(p, st, t, s, top, total) for p, st, s in zip(parts, stats, shards)], dim=1)
    # Each entry exp(l - max - log Z) / N: Z summed in another order (|dZ| <= vocab u Z, so a relative
    # difference of at most vocab u in every softmax entry, the log's and exp's own rounding on top).
    bound = (vocab + 8) * u * logits.grad.abs() + u / n
    assert ((grad - logits.grad).abs() <= bound).all(), float(((grad - logits.grad).abs() / bound).max())


@pytest.mark.parametrize("overrides, must_contain", [
    (["parallel.pp=2", "parallel.head=vocab", "schedule=pipedream"], ["parallel.head=vocab", "pipedream"]),
    (["parallel.pp=2", "parallel.head=vocab", "schedule=gpipe"], ["parallel.head=vocab", "gpipe"]),
    (["parallel.pp=2", "parallel.head_split=tokens"], ["parallel.head_split", "parallel.head=last, vocab or auto"]),
    # The token head split was removed (the vocabulary-parallel head matched or beat it where measured): its two
    # keys name the replacement.
    (["parallel.pp=2", "parallel.head=tokens"], ["parallel.head=tokens", "removed", "use parallel.head=vocab"]),
    (["parallel.pp=2", "parallel.head_split_tokens=100"], ["parallel.head_split_tokens", "removed",
                                                           "use parallel.head=vocab"]),
    (["model=tiny_dense", "parallel.pp=2", "parallel.tp=2", "parallel.head=vocab"], ["parallel.tp=2", "tied",
                                                                                   "tie_embeddings=false"]),
    (["model=tiny_dense", "parallel.pp=2", "parallel.head=vocab", "parallel.vocab_shards=[100,100]"],
     ["parallel.vocab_shards=[100, 100]", "vocab_size=8192"]),
    (["model=tiny_dense", "+model.overrides.tie_embeddings=false", "parallel.pp=2", "parallel.tp=2",
      "parallel.head=vocab", "parallel.vocab_shards=[4095,4097]"], ["multiple of parallel.tp=2"]),
    (["parallel.head=last", "parallel.vocab_shards=[4096,4096]"], ["needs parallel.head=vocab"]),
    (["parallel.head=sideways"], ["parallel.head='sideways'", "'last', 'vocab', 'auto'"]),
    # One stage: nothing to spread the vocabulary over (accepted, it would run the head whole without a word).
    (["model=tiny_dense", "parallel.pp=1", "parallel.head=vocab"], ["parallel.head=vocab", "parallel.pp=1",
                                                                    "use parallel.head=last or auto"]),
    (["model=tiny_dense", "+model.overrides.tie_embeddings=false", "parallel.pp=1", "parallel.tp=2",
      "parallel.head=vocab"], ["parallel.head=vocab", "parallel.pp=1", "vocabulary-parallel over the TP ranks"]),
])
def test_refusals_name_the_field_and_the_fix(overrides, must_contain):
    with pytest.raises(ConfigError) as e:
        check(overrides)
    for text in must_contain:
        assert text in str(e.value), (text, str(e.value))


def test_auto_at_one_stage_is_accepted_and_keeps_the_head_last():
    cfg, model_cfg = check(["model=tiny_dense", "parallel.pp=1", "parallel.head=auto"])
    assert head_of(cfg, model_cfg) == "last" and vocab_shards_of(cfg, model_cfg) is None


@pytest.mark.parametrize("schedule", ["2bw", "1f1b", "sync"])
def test_accepted_layouts_place_the_head_passes_on_every_stage(schedule):
    """Every rank derives the same lists: the shards sum to the vocabulary, the layer split is the config's, and
    the placed schedule passes the invariant checker (one S and one T per microbatch on every stage, F < S < T < B
    on one version, one collective order, no deadlock)."""
    cfg, model_cfg = check(["model=tiny_dense", "parallel.pp=4", "parallel.head=vocab", f"schedule={schedule}",
                            "train.num_microbatches=4"])
    split = run_vocab_split(cfg, model_cfg)
    assert sum(split.shards) == model_cfg.vocab_size == sum(vocab_shards_of(cfg, model_cfg))
    placement = vocab_placement(schedule, 4, split)
    lists = vocab_pipeline(schedule, 4, [1 if schedule == "2bw" else 0] * 3, split, placement)
    check_schedules(lists, 4, None)
    for stage in lists:
        assert sum(a.op is Op.VOCAB_FORWARD for a in stage) == sum(a.op is Op.VOCAB_BACKWARD for a in stage) == 12
    assert vocab_pipeline(schedule, 4, [1 if schedule == "2bw" else 0] * 3, split, placement) == lists
    assert VocabShard(0, split.shards[0]) == vocab_shards(split.shards, model_cfg.vocab_size)[0]


def test_an_explicit_placement_is_refused_with_its_reason_before_anything_is_built():
    """parallel.vocab_placement: its shape and its head by the config validator; its validity at the run's pp and m
    by the preflight (it needs the model's costs), each naming the key, the value and the fix."""
    base = ["model=tiny_dense", "parallel.pp=2"]
    with pytest.raises(ConfigError, match=r"parallel.vocab_placement=\[0, 1\] must be \[warm-up, slack\]"):
        check([*base, "parallel.head=vocab", "parallel.vocab_placement=[0,1]"])
    with pytest.raises(ConfigError, match=r"parallel.vocab_placement=\[2, 1\] needs parallel.head=vocab"):
        check([*base, "parallel.head=last", "parallel.vocab_placement=[2,1]"])
    cfg, model_cfg = check([*base, "parallel.head=vocab", "parallel.vocab_placement=[2,1]", "train.num_microbatches=2"])
    with pytest.raises(ConfigError, match="version not produced yet.*raise train.num_microbatches"):
        check_vocab_placement(cfg, model_cfg)  # three forwards ahead on stage 0 with two microbatches a step
    cfg, model_cfg = check([*base, "parallel.head=vocab", "parallel.vocab_placement=[2,1]", "train.num_microbatches=4"])
    check_vocab_placement(cfg, model_cfg)
    assert run_vocab_placement(cfg, run_vocab_split(cfg, model_cfg)) == VocabPlacement(2, 1)
