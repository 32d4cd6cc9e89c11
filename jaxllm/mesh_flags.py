"""The mesh and multi-process flags shared by `python -m jaxllm.generate` and `python -m jaxllm.serve`.

    --tensor-parallel N --instances M                 the mesh (EngineOptions.tensor_parallel / instances)
    --coordinator HOST:PORT --num-processes P --process-id I
                                                      a multi-process run (or JAX_COORDINATOR_ADDRESS,
                                                      JAX_NUM_PROCESSES, JAX_PROCESS_ID; with none of
                                                      them, a run `srun` or `mpirun` started joins
                                                      through jax's own cluster detection)
    --coordinator-timeout S                           how long joining may take (or
                                                      JAXLLM_COORDINATOR_TIMEOUT; default 300 s)

`start_processes` must run before anything touches a device (jax.distributed.initialize's rule). Beside them
the other engine flags both entry points share: --compile-cache and --tuner (add_compile_flags), --host-kv-gib
(add_host_tier_flag; `host_kv_bytes` reads it), and speculative decoding's --speculative, --speculative-model and
--num-speculative-tokens (add_speculative_flags; `speculative_options` reads them).
"""

from __future__ import annotations

import argparse


def add_mesh_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mesh and multi-process runs")
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N devices (default: 1)")
    g.add_argument("--instances", type=int, default=1, metavar="M",
                   help="serving instances on the mesh's instance axis (default: 1)")
    g.add_argument("--no-lending", action="store_true",
                   help="instances do not lend each other KV rBlocks (each lives within its own pool; default: "
                        "they lend, so one sequence may use every instance's pool)")
    g.add_argument("--no-spread-prompts", action="store_true",
                   help="a long prompt is prefilled chunk by chunk on its home instance (default: by every instance "
                        "at once, its rBlocks striped across them: context-parallel prefill)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address, the same on every process of a multi-process run "
                        "(default: $JAX_COORDINATOR_ADDRESS, else the one jax derives under srun or mpirun; "
                        "none: one process)")
    g.add_argument("--num-processes", type=int, default=None, metavar="P",
                   help="processes in the run (default: $JAX_NUM_PROCESSES, else 1)")
    g.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="this process's index, 0 .. P-1; process 0 schedules and serves (default: $JAX_PROCESS_ID)")
    g.add_argument("--coordinator-timeout", type=float, default=None, metavar="S",
                   help="seconds to wait for the coordinator and every process to join; past them the process "
                        "exits with status 2, naming the address (default: $JAXLLM_COORDINATOR_TIMEOUT, else 300)")


def start_processes(args: argparse.Namespace, prog: str) -> bool:
    """Join the multi-process run the flags (or the JAX_* variables, or a cluster launcher's environment) name;
    whether this is one. Raises ValueError on an incomplete or malformed set; a run that does not start in time
    ends the process (status 2, `prog: error: ...` naming the coordinator). A follower's SIGTERM / SIGINT then
    goes to process 0, which stops the whole run (sharding.liveness); what libraries write to stdout's
    descriptor (gloo's connection lines) goes to stderr, so stdout holds the product alone (jaxllm.console)."""
    from jaxllm import console
    from sharding import multihost

    joined = multihost.initialize(args.coordinator, args.num_processes, args.process_id,
                                  timeout=args.coordinator_timeout, prog=prog)
    if joined:
        multihost.forward_signals()
        console.library_stdout_to_stderr()
    return joined


def is_leader() -> bool:
    """Process 0 (always, on one process): the one that schedules, serves and prints."""
    import jax

    return jax.process_index() == 0


def add_compile_flags(parser: argparse.ArgumentParser) -> None:
    """--compile-cache and --tuner: how steps are compiled and which kernels they run (generate and serve)."""
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="JAX's persistent compilation cache in DIR, so a restart compiles nothing "
                             "(default: $JAXLLM_COMPILE_CACHE; unset: off)")
    parser.add_argument("--tuner", choices=("auto", "fixed"), default="auto",
                        help="each step's kernels: auto (the learned cost model where one was trained for this GPU, "
                             "else fixed) or fixed (the backend's own kernels) (default: auto)")


def add_host_tier_flag(parser: argparse.ArgumentParser) -> None:
    """--host-kv-gib: the host tier's size (EngineOptions.host_kv_bytes; generate and serve)."""
    parser.add_argument("--host-kv-gib", type=float, default=None, metavar="GIB",
                        help="pinned host memory for each instance's KV rBlocks, in GiB: preempted sequences swap "
                             "there instead of recomputing, and the prefix cache spills there (default 0: off; "
                             "one process only)")


def host_kv_bytes(args: argparse.Namespace) -> int | None:
    """EngineOptions.host_kv_bytes from --host-kv-gib (None: the default); ValueError naming a bad value."""
    gib = args.host_kv_gib
    if gib is None:
        return None
    if not gib >= 0 or gib == float("inf"):  # also refuses NaN
        raise ValueError(f"--host-kv-gib must be a finite number >= 0 (0 turns the host tier off), got {gib}")
    return int(gib * (1 << 30))


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding's flags (EngineOptions.speculative, speculative_model, num_speculative_tokens)."""
    g = parser.add_argument_group("speculative decoding (the same tokens greedily, the same distribution sampled)")
    g.add_argument("--speculative", default=None, metavar="ngram:K",
                   help="prompt lookup: each step drafts up to K tokens that followed the latest match of the "
                        "sequence's last tokens in its own prompt and output, checked in one verify step")
    g.add_argument("--speculative-model", default=None, metavar="MODEL",
                   help="a draft model instead (a preset or checkpoint directory with the target's tokenizer), run "
                        "on the first device beside the target with its own KV pool (one process)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="draft tokens a step (with --speculative-model; with --speculative ngram the same as ngram:K)")


def speculative_options(args: argparse.Namespace) -> dict:
    """EngineOptions' speculative fields from add_speculative_flags' flags (EngineOptions checks them)."""
    return dict(speculative=args.speculative, speculative_model=args.speculative_model,
                num_speculative_tokens=args.num_speculative_tokens)
