"""One-question experiments: each answers one question the core benchmark does not ask
every run (a client's CPU per request, synchronous versus asynchronous commits, the
console's cost, the tracing extra's cost, ...). Each runs alone as
``python -m bench.experiments.<name>``; its last results are in bench/README.md."""
