export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
which ncu || ls /opt/nvidia/nsight-compute/*/ncu
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for dt in int8 bf16; do
  timeout 240 $NCU --clock-control none --kernel-name regex:ragged_decode --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats \
    python3 benchmarks/experiments/session10-probes/decode_one.py $dt > $OUT/ncu-$dt.txt 2>&1
  echo "== $dt rc $?"; grep -E 'Duration|Registers Per|Shared Memory Config|Dynamic Shared|Static Shared|Theoretical Occ|Achieved Occ|Block Limit|Issue Slots Busy|Issued Ipc|No Eligible|Memory Throughput|DRAM Through|Compute \(SM\) Through|Executed Instructions  |Warp Cycles Per Issued|Stall' $OUT/ncu-$dt.txt | head -40
done
