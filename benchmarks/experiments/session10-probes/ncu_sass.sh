export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for dt in int8 bf16; do
  timeout 240 ncu --clock-control none --kernel-name regex:ragged_decode --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section InstructionStats -o /tmp/rep-$dt -f python3 benchmarks/experiments/session10-probes/decode_one.py $dt > /dev/null 2>&1
  echo "rc $?"
  ncu -i /tmp/rep-$dt.ncu-rep --page source --print-source sass --csv > $OUT/sass-$dt.csv 2>&1
  wc -l $OUT/sass-$dt.csv; head -3 $OUT/sass-$dt.csv | cut -c1-300
  ncu -i /tmp/rep-$dt.ncu-rep --page details --print-details all > $OUT/details-$dt.txt 2>&1; grep -i -A25 'Instruction Statistics' $OUT/details-$dt.txt | head -40
done
