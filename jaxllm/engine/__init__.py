"""The engine: pure Python over integer ids, no jax. The core's loop (core.py: admit, plan, dispatch, stream), the
scheduler of one instance (scheduler.py, its admission and chunking rules in scheduling.py) and the instance set
(instances.py), the rBlock allocators (allocator.py, lending.py over distkv.py's ledger), the host tier's ledger
(host_tier.py), requests and their outputs (requests.py, sequence.py, output.py), the threaded engine the servers
drive (threaded.py), and the StepRunner protocol the executor implements (step_runner.py)."""
