"""sample_tokens (greedy, temperature, top-k, top-p, per-row seeds) and stop tokens, end to end.

Random logits are drawn from a fresh seed each run (printed; replay with JAXLLM_TEST_SEED=<seed>).
"""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.engine.allocator import BlockAllocator
from jaxllm.contract import SamplingParams
from jaxllm.executor.sampler import greedy_tokens, sample_tokens
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Status
from tests.seeds import seed

_sample = jax.jit(sample_tokens)


def test_greedy_tokens_are_numpys_argmax_ties_and_nans_included():
    """The two-reduction argmax (first maximum, first NaN) against NumPy's argmax, on rows with ties at the
    top, a NaN, an all-equal row, and bfloat16 logits."""
    rng = np.random.default_rng(_seed())
    logits = rng.standard_normal((6, 300)).astype(np.float32)
    logits[1, [7, 250]] = logits[1].max() + 1.0  # a tie at the top: the first wins
    logits[2, 123] = np.nan
    logits[2, 200] = np.nan
    logits[3] = 0.5
    logits[4, -1] = 9.0  # the last id
    want = np.argmax(logits, axis=-1)
    assert want[1] == 7 and want[2] == 123 and want[3] == 0 and want[4] == 299
    assert np.array_equal(np.asarray(jax.jit(greedy_tokens)(jnp.asarray(logits))), want)
    half = jnp.asarray(logits[[0, 1, 3, 4, 5]], jnp.bfloat16)
    assert np.array_equal(np.asarray(greedy_tokens(half)), np.argmax(np.asarray(half, np.float32), axis=-1))


def _seed() -> int:
    return seed(39160)  # fixed: tests/seeds.py


def _draw(logits, temperature, top_k, top_p, seeds, positions) -> np.ndarray:
    rows = len(logits)

    def col(x, dtype):
        return np.broadcast_to(np.asarray(x, dtype), (rows,)).copy()

    out = _sample(np.asarray(logits, np.float32), col(temperature, np.float32), col(top_k, np.int32),
                  col(top_p, np.float32), col(seeds, np.int32), col(positions, np.int32))
    return np.asarray(out)


def _distinct_logits(rng, shape, spread=3.0) -> np.ndarray:
    """Random float32 logits over about 4*spread with no near-ties in a row (unambiguous argmax and order)."""
    values = np.cumsum(rng.uniform(0.1, 1.0, shape), axis=-1)  # strictly increasing, gaps >= 0.1 / ~0.55 vocab
    values = (values / values[..., -1:] - 0.5) * 4 * spread
    return rng.permuted(values, axis=-1).astype(np.float32)


def _target(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 oracle: softmax(logits / T) restricted to the top-k, then to the top-p nucleus."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    zs = z[order]
    keep = np.ones(len(z), bool)
    if top_k > 0:
        keep[top_k:] = False
    probs = np.where(keep, np.exp(zs - zs.max()), 0.0)
    probs /= probs.sum()
    # The nucleus: the most likely tokens whose mass before them is below top_p (the first always).
    keep &= (np.cumsum(probs) - probs < top_p) | (np.arange(len(z)) == 0)
    final = np.where(keep, np.exp(zs - zs.max()), 0.0)
    out = np.zeros(len(z))
    out[order] = final / final.sum()
    return out


# ----- greedy and its limits -----

def test_greedy_is_argmax_whatever_top_k_and_top_p():
    rng = np.random.default_rng(_seed())
    rows, vocab = 37, 101
    logits = _distinct_logits(rng, (rows, vocab))
    got = _draw(logits, 0.0, rng.integers(0, 5, rows), rng.uniform(0.05, 1.0, rows), rng.integers(0, 2**31, rows),
                rng.integers(0, 4096, rows))
    assert np.array_equal(got, logits.argmax(-1))


def test_top_k_1_and_tiny_top_p_are_greedy():
    rng = np.random.default_rng(_seed())
    rows, vocab = 53, 67
    logits = _distinct_logits(rng, (rows, vocab), spread=0.3)  # flat: plain sampling would rarely pick argmax
    temperature = rng.uniform(0.5, 3.0, rows)
    seeds, positions = rng.integers(0, 2**31, rows), rng.integers(0, 4096, rows)
    assert np.array_equal(_draw(logits, temperature, 1, 1.0, seeds, positions), logits.argmax(-1))
    assert np.array_equal(_draw(logits, temperature, 0, 1e-6, seeds, positions), logits.argmax(-1))
    # The same rows without the limits do sample: otherwise the two checks above prove nothing.
    assert not np.array_equal(_draw(logits, temperature, 0, 1.0, seeds, positions), logits.argmax(-1))


# ----- the sampled distribution -----

def test_empirical_distribution_matches_restricted_softmax():
    seed = _seed()
    rng = np.random.default_rng(seed)
    vocab, n = 7, 20000
    logits = _distinct_logits(rng, (vocab,), spread=1.0)

    def nucleus_p(temperature, top_k, size):
        # A top_p halfway between the masses of the first size-1 and size tokens: no boundary ties.
        probs = np.sort(_target(logits, temperature, top_k, 1.0))[::-1]
        cum = np.cumsum(probs)
        return float((cum[size - 2] + cum[size - 1]) / 2)

    # With both limits, the nucleus is taken over the top-k renormalised (as HF and vLLM do): on flat
    # logits, a nucleus over the full softmax would hold more tokens.
    configs = [(0.7, 0, 1.0), (1.6, 3, 1.0), (1.0, 0, nucleus_p(1.0, 0, 3)), (0.8, 5, nucleus_p(0.8, 5, 2)),
               (2.5, 0, nucleus_p(2.5, 0, 5)), (4.0, 4, nucleus_p(4.0, 4, 3))]
    expected_support = [vocab, 3, 3, 2, 5, 3]
    rows = len(configs) * n
    temperature = np.repeat([c[0] for c in configs], n)
    top_k = np.repeat([c[1] for c in configs], n)
    top_p = np.repeat([c[2] for c in configs], n)
    seeds = rng.choice(2**31 - 1, size=rows, replace=False)
    positions = rng.integers(0, 100000, rows)
    tokens = _draw(np.broadcast_to(logits, (rows, vocab)), temperature, top_k, top_p, seeds, positions)
    for i, (t, k, p) in enumerate(configs):
        want = _target(logits, t, k, p)
        assert (want > 0).sum() == expected_support[i]
        freq = np.bincount(tokens[i * n:(i + 1) * n], minlength=vocab) / n
        ctx = f"seed={seed} T={t} top_k={k} top_p={p}: got {np.round(freq, 4)}, want {np.round(want, 4)}"
        assert np.all(freq[want == 0] == 0), f"{ctx}: sampled outside the top-k / nucleus"
        tol = 5 * np.sqrt(want * (1 - want) / n) + 1e-3  # 5 sigma per token: a false alarm is ~1e-6
        assert np.all(np.abs(freq - want) <= tol), ctx


# ----- seeds -----

def test_rows_are_independent_of_batch_order():
    rng = np.random.default_rng(_seed())
    rows, vocab = 29, 50
    logits = _distinct_logits(rng, (rows, vocab), spread=1.0)
    args = [rng.uniform(0.3, 2.0, rows).astype(np.float32), rng.integers(0, 20, rows), rng.uniform(0.5, 1.0, rows),
            rng.integers(0, 2**31, rows), rng.integers(0, 4096, rows)]
    base = _draw(logits, *args)
    perm = rng.permutation(rows)
    assert np.array_equal(_draw(logits[perm], *[a[perm] for a in args]), base[perm])
    for i in rng.choice(rows, 3, replace=False):  # alone in a batch of one
        assert _draw(logits[i:i + 1], *[a[i:i + 1] for a in args])[0] == base[i]


def test_same_seed_and_position_same_token_else_varied():
    rng = np.random.default_rng(_seed())
    rows, vocab = 256, 64
    flat = np.broadcast_to(_distinct_logits(rng, (vocab,), spread=0.1), (rows, vocab))
    seed, position = int(rng.integers(0, 2**31)), int(rng.integers(0, 4096))
    same = _draw(flat, 1.0, 0, 1.0, seed, position)
    assert len(set(same.tolist())) == 1  # identical rows, identical (seed, position): one token
    assert np.array_equal(_draw(flat, 1.0, 0, 1.0, seed, position), same)  # and again on a second call
    # Near-uniform over 64 tokens: 256 draws that ignored the position or the seed would all coincide.
    by_position = _draw(flat, 1.0, 0, 1.0, seed, np.arange(rows))
    by_seed = _draw(flat, 1.0, 0, 1.0, rng.choice(2**31, rows, replace=False), position)
    assert len(set(by_position.tolist())) > 30 and len(set(by_seed.tolist())) > 30


# ----- stop tokens -----

def test_stop_token_ids_validation():
    assert SamplingParams().stop_token_ids == ()
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert SamplingParams(stop_token_ids=[3, np.int64(7)]).stop_token_ids == (3, 7)
    assert type(SamplingParams(stop_token_ids=[np.int32(1)]).stop_token_ids[0]) is int
    for bad in ([-1], [1.0], ["2"], [True], 5, "12"):
        with pytest.raises(ValueError, match="stop_token_ids"):
            SamplingParams(stop_token_ids=bad)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_scheduler_stops_on_stop_token_without_appending_it(ignore_eos):
    eos = 2
    alloc = BlockAllocator(8)
    sched = Scheduler(alloc, 4, max_tokens_per_step=64, max_seqs=4)
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(5, 9), ignore_eos=ignore_eos)
    a = sched.add([1, 1, 1], params, max_len=64)
    b = sched.add([1, 1], params, max_len=64)
    for step_tokens in ([7, eos], [9, 4]):
        plan = sched.plan()
        sched.update(plan, np.array(step_tokens[:plan.num_seqs]), eos)
    # a: 7 then the stop token 9. b: EOS (a stop unless ignore_eos), then 4.
    assert (a.status, a.finish_reason, a.output_ids) == (Status.FINISHED, "stop", [7])
    if ignore_eos:
        assert b.status is Status.RUNNING and b.output_ids == [eos, 4]
        plan = sched.plan()
        sched.update(plan, np.array([5]), eos)  # stop tokens still stop when EOS is ignored
        assert b.output_ids == [eos, 4]
    assert (b.status, b.finish_reason) == (Status.FINISHED, "stop") and b.output_ids == ([eos, 4] if ignore_eos else [])
    assert alloc.num_free == 8 and not sched.has_work()


def test_llm_generate_and_stream_stop_token_ids():
    from jaxllm import LLM, EngineOptions

    llm = LLM("tiny", max_context=64, options=EngineOptions(block_size=8, max_tokens_per_step=32), progress=False)
    seed = int(np.random.default_rng(_seed()).integers(0, 2**31 - 100))
    while True:  # a random model may sample EOS at once; then another seed
        kwargs = dict(max_new_tokens=12, temperature=1.0, seed=seed)
        base = llm.generate(["stop tokens"], **kwargs)[0]
        if len(base.token_ids) >= 2:
            break
        seed += 1
    stop = [base.token_ids[len(base.token_ids) // 2]]
    cut = base.token_ids.index(stop[0])  # its first occurrence
    out = llm.generate(["stop tokens"], stop_token_ids=stop + [llm.config.vocab_size + 5], **kwargs)[0]
    assert (out.finish_reason, out.token_ids) == ("stop", base.token_ids[:cut])
    if cut:
        assert out.text == llm.generate(["stop tokens"], **{**kwargs, "max_new_tokens": cut})[0].text
    assert "".join(llm.stream("stop tokens", stop_token_ids=stop, **kwargs)) == out.text
    assert llm.core.stats().scheduler.pool_blocks_free == llm.core.stats().scheduler.pool_blocks
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["x"], max_new_tokens=2, stop_token_ids=[-3])


def test_sample_follows_the_token_not_its_rank():
    """Rounding that swaps two near-equal logits (another batch shape) must not change the sample."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(64).astype(np.float32)
    a, b = 5, 9
    logits[a], logits[b] = 4.0, 4.0 + 1e-6  # the two likeliest tokens, b ranked first
    swapped = logits.copy()
    swapped[b] = 4.0 - 1e-6  # now a ranks first: the same distribution up to rounding
    seeds = jnp.arange(200, dtype=jnp.int32)
    positions = jnp.full((200,), 17, jnp.int32)
    args = (jnp.full((200,), 0.9, jnp.float32), jnp.full((200,), 40, jnp.int32), jnp.full((200,), 0.95, jnp.float32),
            seeds, positions)
    first = np.asarray(sample_tokens(jnp.tile(jnp.asarray(logits), (200, 1)), *args))
    second = np.asarray(sample_tokens(jnp.tile(jnp.asarray(swapped), (200, 1)), *args))
    assert set(first) >= {a, b}  # both likely tokens are drawn across the seeds
    np.testing.assert_array_equal(first, second)
