set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 benchmarks/experiments/session10-probes/l2_prefetch_evict_check.py 2>&1 | grep -v Warn | tail -5
timeout 200 python3 -m pytest -q -x tests/jaxllm/test_model.py -k kernel_backend 2>&1 | tail -3
off="JAXLLM_PF_ATTN_MB=0 JAXLLM_PF_NORM_MB=0 JAXLLM_PF_XLA_MB=0"
for v in off attn all norm16; do
  case $v in off) e=$off;; attn) e="JAXLLM_PF_NORM_MB=0 JAXLLM_PF_XLA_MB=0";; all) e="";; norm16) e="JAXLLM_PF_NORM_MB=16 JAXLLM_PF_XLA_MB=16";; esac
  mkdir -p $OUT/prof-$v
  env $e timeout 150 python3 scripts/profile_decode_step.py --contexts 1024 --out $OUT/prof-$v 2>&1 | tail -2
done
python3 benchmarks/experiments/session10-probes/summarize_profiles.py $OUT
for r in 1 2; do for v in off all; do
  case $v in off) e=$off;; all) e="";; esac
  mkdir -p $OUT/gen-$v-$r
  env $e timeout 150 python3 scripts/bench_generate.py --contexts 1024 --out $OUT/gen-$v-$r 2>&1 | grep -E '^ +1024' | tail -1
done; done
