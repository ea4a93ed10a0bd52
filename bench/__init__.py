"""The side-by-side benchmark: ``python -m bench.run`` or ``bench/run.sh``.

Not part of the installed package: it drives the service, pgbench and the
Python peers (PgQueuer, Procrastinate) against one durable embedded
PostgreSQL 18 and reports medians over interleaved rounds.
"""
