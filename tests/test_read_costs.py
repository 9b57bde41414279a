"""Unit tests of the estimate that decides whether a re-read block is fetched whole."""

from __future__ import annotations

from fusestate.blocks.read_costs import MIN_BUCKET_SAMPLES, ReadCosts


def test_promotes_until_the_bucket_has_been_timed() -> None:
    costs = ReadCosts()
    for _ in range(MIN_BUCKET_SAMPLES - 1):
        costs.bucket(0.0001)
    assert costs.promotion_pays()  # too few samples: behave as for a remote bucket
    costs.bucket(0.0001)
    assert not costs.promotion_pays()


def test_a_bucket_as_fast_as_local_disk_is_not_worth_promoting_for() -> None:
    costs = ReadCosts()
    for _ in range(32):
        costs.bucket(0.0015)  # a file:// bucket on a busy node
        costs.local(0.0009)
    assert not costs.promotion_pays()
    assert costs.summary() == {"bucket": 1.5, "local": 0.9, "bucket_samples": 32, "promote": False}


def test_a_remote_bucket_is_worth_promoting_for_and_one_slow_read_moves_nothing() -> None:
    remote = ReadCosts()
    for _ in range(32):
        remote.bucket(0.020)
        remote.local(0.0004)  # below the floor: counts as 0.5 ms
    assert remote.promotion_pays()

    local = ReadCosts()
    for _ in range(32):
        local.bucket(0.0003)
    local.bucket(5.0)  # one read stuck behind a burst of writes
    assert not local.promotion_pays()  # the median, not the mean


def test_the_mode_overrides_the_measurement() -> None:
    always, never = ReadCosts("always"), ReadCosts("never")
    for costs in (always, never):
        for _ in range(32):
            costs.bucket(0.0001)
    assert always.promotion_pays() and not never.promotion_pays()
    assert not ReadCosts("never").promotion_pays()  # not even before any sample
