"""`jaxllm <command> ...` (or `python -m jaxllm.cli`): command-line tools over the library.

Each subcommand is a pair: `_add_<name>(subparsers)` declares its arguments and sets `run`
to a function of the parsed args that returns an exit code. Adding a command is one more
pair and one line in `_COMMANDS`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from jaxllm.model import checkpoints as weights
from jaxllm.model.config import PRESETS


def _convert(args: argparse.Namespace) -> int:
    if args.src in PRESETS:  # the other way: a preset as a HuggingFace directory anything can read, offline
        from jaxllm.model.hf_tokenizer import save_byte_tokenizer

        sharding = None
        if args.tensor_parallel > 1:  # drawn in shards over that many devices: no device holds the model whole
            import functools

            from sharding.mesh import make_mesh
            from sharding.rules import load_sharding

            sharding = functools.partial(load_sharding, mesh=make_mesh(args.tensor_parallel))
        model, _ = weights.load_model(args.src, dtype=args.dtype, sharding=sharding)
        weights.save_hf(model, args.dst)
        save_byte_tokenizer(args.dst)
        print(f"wrote HuggingFace checkpoint of the {args.src} preset ({model.config.num_layers} layers, random "
              f"weights, byte-level tokenizer.json) to {os.path.abspath(args.dst)}")
        return 0
    model = weights.load_hf(args.src, dtype=args.dtype, progress=not args.quiet)
    weights.save_orbax(model, args.dst, tokenizer_dir=args.src)
    print(f"wrote Orbax checkpoint of {model.config.name} ({model.config.num_layers} layers) to "
          f"{os.path.abspath(args.dst)}")
    return 0


def _add_convert(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert a HuggingFace checkpoint directory to an Orbax one, or write "
                                              "a preset as a HuggingFace directory",
                              description="Read config.json + safetensors from SRC, write an Orbax checkpoint "
                                          "(plus jaxllm_config.json and tokenizer files) to DST. With a preset name "
                                          "as SRC (e.g. tiny), write that preset to DST as a HuggingFace directory "
                                          "instead: config.json, model.safetensors (its random weights) and its "
                                          "byte-level tokenizer as tokenizer.json, offline.")
    p.add_argument("src", metavar="SRC", help="HuggingFace model directory (config.json + *.safetensors), or a "
                   f"preset name ({', '.join(sorted(PRESETS))})")
    p.add_argument("dst", metavar="DST", help="output directory (new, empty, or an earlier conversion)")
    p.add_argument("--dtype", choices=sorted(weights.MODEL_DTYPES), default=None,
                   help="parameter dtype to store (default: the checkpoint's)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="with a preset: draw its weights in shards over N devices (a model larger than one device; "
                        "they are written out one tensor at a time through host memory)")
    p.set_defaults(run=_convert)


_COMMANDS: tuple[Callable, ...] = (_add_convert,)


def _prog() -> str:
    """How the user started us: the installed `jaxllm` script, or `python -m jaxllm.cli`."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m jaxllm.cli" if name in ("", "cli.py", "__main__.py", "-c") else name


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog or _prog(), description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse argv (default sys.argv[1:]), run the command; user errors print one line and return 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as e:  # CheckpointError, ConfigError and bad arguments: the user's to fix
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
