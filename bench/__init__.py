"""fusestate benchmark harness: named scenarios, machine-readable results, a generated report.

Run it with ``bench/run`` (or ``python -m bench``); see bench/README.md.
"""
