"""A checkpoint's `generation_config.json` defaults (EOS ids, temperature, top_p, top_k), used when a
request gives none.

As vLLM reads it: only sampling keys the file states are defaults; `do_sample: false` means greedy,
so its sampling keys are dropped (transformers ignores them too). EOS ids from the file and from
config.json all stop generation.
"""

from __future__ import annotations

import dataclasses
import json
import os

GENERATION_CONFIG = "generation_config.json"
# Our own defaults when neither the request nor the checkpoint gives one: greedy, no top-k, no top-p.
_FALLBACK = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults a checkpoint ships; None: the checkpoint states none."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be ids >= 0, got {self.eos_token_ids!r}")
        if self.temperature is not None and not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k is not None and not self.top_k >= 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    def resolve(self, temperature: float | None, top_k: int | None, top_p: float | None
                ) -> tuple[float, int, float]:
        """(temperature, top_k, top_p): a request's value where it gives one, else this default, else ours."""
        out = []
        for name, given in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
            default = getattr(self, name)
            out.append(given if given is not None else default if default is not None else _FALLBACK[name])
        return tuple(out)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is malformed: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _eos_ids(raw: dict, where: str) -> list[int]:
    eos = raw.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"{where}: eos_token_id {eos!r} is not an id or a list of ids")
    return ids


def load_generation_defaults(model_dir: str | os.PathLike | None) -> GenerationDefaults:
    """The defaults of `model_dir`'s generation_config.json (EOS ids also from config.json); none for None."""
    if model_dir is None:
        return GenerationDefaults()
    model_dir = os.fspath(model_dir)
    eos: list[int] = []
    sampling = {}
    path = os.path.join(model_dir, GENERATION_CONFIG)
    if os.path.isfile(path):
        raw = _read_json(path)
        eos += _eos_ids(raw, path)
        if raw.get("do_sample", True) is not False:
            for key, kind in (("temperature", float), ("top_k", int), ("top_p", float)):
                value = raw.get(key)
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                    raise ValueError(f"{path}: {key} {value!r} is not a number")
                sampling[key] = kind(value)
    config_path = os.path.join(model_dir, "config.json")
    if os.path.isfile(config_path):
        eos += _eos_ids(_read_json(config_path), config_path)
    try:
        return GenerationDefaults(eos_token_ids=tuple(dict.fromkeys(eos)), **sampling)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
