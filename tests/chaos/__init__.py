"""Fault injection against real processes (issue 12): kill -9 under load, Redis killed and hung,
a full records store, slow and hostile clients, fuzzed requests. `harness` starts and breaks the
processes, `clients` drives them and keeps the books of acknowledged turns, `probes` measures
(/healthz latency, stream stalls, the block pool); each scenario module has a `run` that the
tests call small and bench/chaos.py calls long."""
