"""The shared metadata engine, for a volume many nodes mount read-write: PostgreSQL
(``engine``), its transport (``pool``: connections and failover; ``pipeline``: a
transaction's statements through libpq; ``loop_io``: their waits on the event loop), the
functions it runs on the server (``functions``), and the other nodes' changes
(``change_feed``) that keep its ``lookup_cache`` true."""
