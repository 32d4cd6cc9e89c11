"""Comparing greedy tokens of two engines whose steps have different shapes.

Engines of different meshes, pools or batches run the same model with different step shapes (rBlock-table
widths, batch rows, chunking), so their float32 logits differ in the last bits (2e-4 at most measured on the
tiny model: benchmarks/NOTES.md, "greedy ties"). Where the reference's two best tokens are closer than that,
greedy decoding may take either; from there the two sequences go their own ways. `assert_same_greedy` checks
that every token up to the first difference is equal, that the difference falls on a near-tie of the
reference, and that every token after it is still the reference model's greedy choice (teacher-forced on the
run's own output) within the tie tolerance: a real bug moves logits by O(1) and fails it.
"""

import numpy as np

TIE = 2e-3  # logits closer than this are a tie (10x the largest shape-to-shape difference measured)


def assert_same_greedy(reference, prompt: list[int], got: list[int], want: list[int], tol: float = TIE) -> None:
    """got (an engine's greedy tokens after prompt) equals want (the reference engine's), up to ties."""
    assert len(got) == len(want), (got, want)
    first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is None:
        return
    logits = reference.logits(list(prompt) + list(got[:-1]))
    rows = logits[len(prompt) - 1:]  # row j: the distribution token j was drawn from
    gap = rows[first, want[first]] - rows[first, got[first]]
    assert abs(gap) < tol, (f"token {first}: {got[first]} instead of {want[first]}, whose logit is {gap:.3g} higher: "
                            f"not a tie (got {got}, want {want})")
    for j in range(first, len(got)):
        short = float(np.max(rows[j]) - rows[j, got[j]])
        assert short < tol, f"token {j}: {got[j]} is {short:.3g} below the reference's best {int(np.argmax(rows[j]))}"
