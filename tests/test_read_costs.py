"""Unit tests of the estimate that decides whether cold reads fetch whole blocks."""

from __future__ import annotations

from fusestate.blocks.read_costs import MIN_BUCKET_SAMPLES, ReadCosts


def test_whole_blocks_until_the_bucket_has_been_timed() -> None:
    costs = ReadCosts()
    for _ in range(MIN_BUCKET_SAMPLES - 1):
        costs.bucket(0.0001)
    assert costs.whole_blocks_pay()  # too few samples: behave as for a remote bucket
    costs.bucket(0.0001)
    assert not costs.whole_blocks_pay()


def test_a_bucket_as_fast_as_local_disk_is_read_by_range() -> None:
    costs = ReadCosts()
    for _ in range(32):
        costs.bucket(0.0015)  # a file:// bucket on a busy node
        costs.local(0.0009)
    assert not costs.whole_blocks_pay()
    assert costs.summary() == {"bucket": 1.5, "local": 0.9, "bucket_samples": 32, "whole_blocks": False,
                               "on_event_loop": False}


def test_a_remote_bucket_is_worth_whole_blocks_and_one_slow_read_moves_nothing() -> None:
    remote = ReadCosts()
    for _ in range(32):
        remote.bucket(0.020)
        remote.local(0.0004)  # below the floor: counts as 0.5 ms
    assert remote.whole_blocks_pay()

    local = ReadCosts()
    for _ in range(32):
        local.bucket(0.0003)
    local.bucket(5.0)  # one read stuck behind a burst of writes
    assert not local.whole_blocks_pay()  # the median, not the mean


def test_the_mode_overrides_the_measurement() -> None:
    always, never = ReadCosts("always"), ReadCosts("never")
    for costs in (always, never):
        for _ in range(32):
            costs.bucket(0.0001)
    assert always.whole_blocks_pay() and not never.whole_blocks_pay()
    assert not ReadCosts("never").whole_blocks_pay()  # not even before any sample


def test_the_verdict_follows_the_bucket_when_it_slows_down() -> None:
    costs = ReadCosts()
    for _ in range(32):
        costs.bucket(0.0003)
    assert not costs.whole_blocks_pay()
    for _ in range(64):  # the bucket turns remote-like: the window fills with slow reads
        costs.bucket(0.020)
        costs.whole_blocks_pay()  # asked all along, as the read path does
    assert costs.whole_blocks_pay()
    assert costs.summary()["whole_blocks"] is True


def test_only_a_bucket_timed_quick_is_read_on_the_event_loop() -> None:
    costs = ReadCosts()
    assert not costs.bucket_is_quick()  # nothing timed yet: worker threads
    for _ in range(MIN_BUCKET_SAMPLES - 1):
        costs.bucket(0.0002)
    assert not costs.bucket_is_quick()
    costs.bucket(0.0002)
    assert costs.bucket_is_quick()  # a file:// bucket on a fast disk
    assert costs.summary()["on_event_loop"] is True
    for _ in range(64):  # its disk turns slow: a blocked loop would hold up every other request
        costs.bucket(0.0015)
        costs.bucket_is_quick()
    assert not costs.bucket_is_quick()
    assert not costs.whole_blocks_pay()  # still no reason to copy whole blocks (1.5 ms < 4 x the 0.5 ms floor)

    remote = ReadCosts("never")  # the whole-blocks override does not decide this
    for _ in range(32):
        remote.bucket(0.020)  # S3
    assert not remote.bucket_is_quick()


def test_a_quick_bucket_no_dearer_than_the_cache_is_read_before_it() -> None:
    costs = ReadCosts()
    for _ in range(32):
        costs.bucket(0.0002)
    assert costs.bucket_is_quick() and not costs.bucket_beats_local()  # the cache's cost unknown
    for _ in range(32):
        costs.local(0.0004)  # the disk cache: a thread hop and an SQLite transaction per read
    assert costs.bucket_beats_local()

    slower = ReadCosts()
    for _ in range(32):
        slower.bucket(0.0006)
        slower.local(0.0002)
    assert slower.bucket_is_quick() and not slower.bucket_beats_local()

    remote = ReadCosts()
    for _ in range(32):
        remote.bucket(0.020)
        remote.local(0.030)  # a cache disk slower still: a remote bucket is never read first
    assert not remote.bucket_beats_local()
