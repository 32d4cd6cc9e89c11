"""Make profiled copies of our Mosaic prefill kernel and of JAX's attention_mgpu (named scopes + profile_space)."""
import inspect, os, re
from jax.experimental.pallas.ops.gpu import attention_mgpu as am

PROF = 'profile_space=64, profile_dir=os.environ["PROF_DIR"]'

src = open("pallas_kernels/ragged_prefill_mgpu.py").read()
src = src.replace("import math\n", "import math\nimport os\n", 1)
src = src.replace("""    @pl.when((wg < _COMPUTE_WGS) & live)
    def _compute():""", """    @pl.when((wg < _COMPUTE_WGS) & live)
    @jax.named_scope("c_all")
    def _compute():""")
src = src.replace("""    @pl.when((wg == _COMPUTE_WGS) & live)
    def _memory():""", """    @pl.when((wg == _COMPUTE_WGS) & live)
    @jax.named_scope("m_all")
    def _memory():""")
old = """        carry = lax.fori_loop(0, my_full, functools.partial(kv_step, masked=False), (acc, m_i, l_i))
        acc, m_i, l_i = lax.fori_loop(my_full, my_nblk, functools.partial(kv_step, masked=True), carry)
        lax.fori_loop(my_nblk, nblk, epilogue_step, None)
        pl.when(wg == 0)(sched_barrier)
"""
assert old in src
new = """        with jax.named_scope("c_loop"):
            carry = lax.fori_loop(0, my_full, functools.partial(kv_step, masked=False), (acc, m_i, l_i))
            acc, m_i, l_i = lax.fori_loop(my_full, my_nblk, functools.partial(kv_step, masked=True), carry)
            lax.fori_loop(my_nblk, nblk, epilogue_step, None)
            pl.when(wg == 0)(sched_barrier)
"""
src = src.replace(old, new)
src = src.replace("compiler_params=plgpu.CompilerParams(approx_math=True),",
                  f"compiler_params=plgpu.CompilerParams(approx_math=True, {PROF}),")
assert src.count("profile_space") == 1
open("benchmarks/experiments/session7-probes/prof_mgpu.py", "w").write(src)

src = open(inspect.getsourcefile(am)).read()
src = src.replace("import math\n", "import math\nimport os\n", 1)
src = re.sub(r"(\n(\s*)@pl\.when\(wg_idx < 2\)\n)(\s*def _compute_wg\(\):)", r'\1\2@jax.named_scope("c_all")\n\3', src, count=1)
src = re.sub(r"(\n(\s*)@pl\.when\(wg_idx == 2\)\n)(\s*def _memory_wg\(\):)", r'\1\2@jax.named_scope("m_all")\n\3', src, count=1)
assert src.count("named_scope(\"c_all\")") == 1 and src.count("named_scope(\"m_all\")") == 1, "scopes"
n0 = src.count("compiler_params=plgpu.CompilerParams(approx_math=True),")
src = src.replace("compiler_params=plgpu.CompilerParams(approx_math=True),",
                  f"compiler_params=plgpu.CompilerParams(approx_math=True, {PROF}),", 1)
print("attention_mgpu CompilerParams sites", n0)
open("benchmarks/experiments/session7-probes/am_prof.py", "w").write(src)
