"""Local servers that the tests, the benchmarks and the one-machine Spark cluster
(``fusestate spark-cluster``) start for themselves: PostgreSQL (``postgres``), PostgreSQL
made highly available with Patroni and etcd (``ha``), and PgBouncer (``pgbouncer``).

A mount never uses them: a shared volume's database is the operator's (docs/deploy.md).
"""
