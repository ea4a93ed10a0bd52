"""The worker's garbage-collector tuning is scoped to the run and undone after it."""

from __future__ import annotations

import gc

from receipts.runtime import GC_GEN0_THRESHOLD, worker_gc


def test_worker_gc_freezes_the_startup_heap_raises_gen0_and_restores_both() -> None:
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    with worker_gc():
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0  # start-up objects are out of the collector's reach
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_worker_gc_restores_the_collector_when_the_run_fails() -> None:
    before = gc.get_threshold()
    try:
        with worker_gc():
            raise RuntimeError("the worker stopped with an error")
    except RuntimeError:
        pass
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
