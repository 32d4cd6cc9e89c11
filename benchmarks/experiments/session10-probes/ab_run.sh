export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONUNBUFFERED=1
R=$PWD
PYTHONPATH=$R timeout 300 python3 -m pytest -q -m gpu tests/pallas_kernels/test_skinny_matmul.py 2>&1 | tail -2
PYTHONPATH=$R timeout 200 python3 -m pytest -q -x tests/jaxllm/test_model.py -k kernel_backend 2>&1 | tail -1
for v in head new; do
  d=$R; [ $v = head ] && d=$R/_head
  (cd $d && PYTHONPATH=$d timeout 150 python3 scripts/profile_decode_step.py --contexts 1024 --out $OUT/prof-$v 2>&1 | tail -1)
done
python3 benchmarks/experiments/session10-probes/summarize_ab.py $OUT
for r in 1 2; do for v in head new; do
  d=$R; [ $v = head ] && d=$R/_head
  (cd $d && PYTHONPATH=$d timeout 150 python3 scripts/bench_generate.py --contexts 1024 --out $OUT/gen-$v-$r 2>&1 | grep -E '^ +1024' | tail -1 | sed "s/^/$v $r /")
done; done
