"""The code the scripts share; the scripts in scripts/ import from here and never from each other.

Scripts run as `python scripts/X.py`, which puts scripts/ first on sys.path, so they import
`from common import harness` or `from common.harness import ...`. No script imports another script, so one
script's private helpers can change without breaking another.

- harness: timing, the device and its HBM floor, result files, tables (every benchmark)
- attention_cases: attention problems, their references and errors (the attention benchmarks and checks)
- gpu_state: SM clock and power sampled with nvidia-smi while a benchmark times
- device_trace: GPU kernel times read from a profiler trace
- tuning_collector: the AutoTuner's tuning-data collection (collect_tuning_data.py, recheck_tuner.py)
- load_report: what the load tests (load_test.py, load_test_http.py) share
- kernel_inputs: ragged kernel inputs with poisoned unused memory (kernel tests and GPU checks)

Nothing here runs at import time: `python scripts/X.py --help` works on a machine without a GPU.
"""
