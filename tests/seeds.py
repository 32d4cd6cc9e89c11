"""Seeds of the randomised tests: fixed, so every run (CI's too) draws the same cases and none can fail at
random; JAXLLM_TEST_SEED replaces them all, to explore other cases by hand (a failure prints the seed)."""

import os


def seed(default: int) -> int:
    """`default`, or $JAXLLM_TEST_SEED when set."""
    return int(os.environ.get("JAXLLM_TEST_SEED", default))
