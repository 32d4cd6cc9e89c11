"""README's examples agree with what the code prints: the start-up of `python -m jaxllm.serve` on the tiny
default (its warm-up count is what warm-up announces, its bar counts to and compiles, for the defaults)."""

from __future__ import annotations

import pathlib
import re

from jaxllm import LLM
from jaxllm.serve import build_parser, engine_options

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _startup_example() -> str:
    """The console block that starts with `$ python -m jaxllm.serve` and nothing else on the line."""
    for block in re.findall(r"```console\n(.*?)```", README.read_text(), flags=re.S):
        if block.startswith("$ python -m jaxllm.serve\n"):
            return block
    raise AssertionError("README has no start-up example of a bare `python -m jaxllm.serve`")


def test_readme_startup_shows_the_warm_up_a_fresh_server_runs():
    example = _startup_example()
    announced = int(re.search(r"^\[jaxllm\] warm-up: (\d+) compiles \(", example, flags=re.M).group(1))
    done, total = map(int, re.search(r"^warm-up compiles: done (\d+)/(\d+) in \d+:\d\d", example, flags=re.M).groups())
    args = build_parser().parse_args([])
    llm = LLM(args.model, max_context=args.max_context, options=engine_options(args), progress=False)
    assert announced == done == total == len(llm.executor.warm_up_plan()), example
    loaded = re.search(r"^loaded tiny \((\d+) layers, max_context (\d+), (\d+) rBlocks of (\d+) tokens\)", example,
                       flags=re.M).groups()
    assert tuple(map(int, loaded)) == (llm.config.num_layers, llm.max_context, llm.num_blocks,
                                       llm.executor.block_size)
