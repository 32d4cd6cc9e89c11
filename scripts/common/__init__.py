"""The code the scripts share: scripts/*.py import it (`from scripts.common import harness`, or `from
scripts.common.harness import ...`) and never each other, so one script's private helpers can change without
breaking another.

- harness: timing, the device and its HBM floor, result files, tables (every benchmark and check)
- gpu_state: SM clock and power sampled with nvidia-smi while a benchmark times (harness.Bench)
- device_trace: GPU kernel times read from a profiler trace (bench_mesh, bench_sampling, bench_skinny_matmul,
  profile_decode_step, trace_tp_step, check_ragged_decode_gpu; collect_tuning_data and recheck_tuner hand its
  `kernel_ns_per_batch` to jaxllm.tuner.collect as the kernel timer)
- attention_cases: attention problems, their references and errors (bench_attention, bench_mosaic_prefill,
  check_ragged_decode_gpu)
- load_report: what the load tests share (load_test, load_test_http; bench_aiperf reads the server's counters with it)

Nothing here has a command line or runs at import time: `python -m scripts.X --help` works on a machine without
a GPU.
"""
