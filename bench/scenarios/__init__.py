"""The named scenarios, in the order ``bench/run`` runs them.

Each module has NAME, TITLE, SUMMARY, BUDGET (seconds per size, or None), ``choices(size) ->
Choices`` (the systems ``--systems`` may name for it and those it runs without, as its ``run``
chooses them; ``bench/run --list`` prints them), ``run(ctx) -> dict``
(the result body: params, systems, summary rows, raw runs; the harness prints its summary
rows as a short table after the run), ``render(doc, img_dir, img_rel) -> str`` (its block in
docs/benchmarks.md: the method, one table, plots) and ``goals(doc) -> list`` (the issue's goals it measures);
optionally ``terminal(doc) -> str``, its summary on the terminal when one table is not enough.
"""

from __future__ import annotations

from types import ModuleType

from bench.scenarios import (bigstate, checkpoint, daemoncpu, failover, files, parallel, restore, rocksdb,
                             spark, sparkcluster, sparkrestart)

SCENARIOS: dict[str, ModuleType] = {m.NAME: m for m in (rocksdb, files, daemoncpu, parallel, failover, bigstate,
                                                          checkpoint, restore, spark, sparkrestart, sparkcluster)}
