"""The embedded metadata engine, for a volume one node writes: SQLite on local disk
(``engine``), its row changes journaled (``journal``), shipped to the bucket after the
blocks they reference (``shipper``), and read back on a fresh node (``restore``)."""
