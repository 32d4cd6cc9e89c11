"""The step tuner (issue 22). STUB until the tunerml merge: tunerml owns this file and its `load_tuner`
(take theirs on merge); this one always returns FixedTuner(base)."""

from jaxllm.tuner.fixed import FixedTuner


def load_tuner(base, **_):
    """FixedTuner(base): no learned model in this branch."""
    return FixedTuner(base)
