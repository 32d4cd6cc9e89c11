"""`python -m serve.client "prompt"` (or `jaxllm-client`): stream a completion to the terminal.

Text goes to stdout as it arrives; `--usage` adds the finish reason, token counts and timing on
stderr. Imports only grpc and the generated stubs, so it starts fast and needs no jax.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import grpc

from serve import jaxllm_pb2 as pb
from serve import jaxllm_pb2_grpc as pb_grpc


def grpc_target(host: str, port: int) -> str:
    """host:port for a gRPC channel or listener, an IPv6 literal in brackets ([::1]:50051)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying an API key (`python -m jaxllm.serve --api-key`), or none."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    request = pb.GenerateRequest(prompt=args.prompt, temperature=args.temperature, top_k=args.top_k,
                                 stop=args.stop or [], ignore_eos=args.ignore_eos,
                                 frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                                 logit_bias=dict(args.logit_bias or []))
    # The proto's optional fields: unset (not zero) where the flag is absent, so the server applies its default.
    for name in ("seed", "max_tokens", "top_p", "repetition_penalty", "logprobs", "prompt_logprobs"):
        if getattr(args, name) is not None:
            setattr(request, name, getattr(args, name))
    return request


def format_logprobs(title: str, entries) -> str:
    """TokenLogprob messages as lines `token_id logprob  top: id:logprob ...` under a title."""
    lines = [title]
    for entry in entries:
        own = f"{entry.logprob:.4f}" if entry.HasField("logprob") else "-"
        top = " ".join(f"{t.token_id}:{t.logprob:.4f}" for t in entry.top)
        lines.append(f"  {entry.token_id:>7} {own:>9}" + (f"  top: {top}" if top else ""))
    return "\n".join(lines)


def _bias(text: str) -> tuple[int, float]:
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serve.client", description=__doc__.splitlines()[0])
    p.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens (default: the server's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="reproducible sampling (default: a fresh random seed)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]; 0 is off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]; 0 is off")
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 0 (default: the server's 1, off)")
    p.add_argument("--logit-bias", action="append", type=_bias, metavar="TOKEN_ID=BIAS",
                   help="add BIAS (in [-100, 100]) to a token's logit (repeatable)")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="print each new token's log-probability and the K most likely tokens (stderr)")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="the same for the prompt's tokens (with --max-tokens 0: score the prompt only)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"),
                   help="sent as 'authorization: Bearer KEY' (default: $JAXLLM_API_KEY; unset: none)")
    p.add_argument("--usage", action="store_true", help="print finish reason, token counts and timing to stderr")
    p.add_argument("--info", action="store_true", help="print the server's ModelInfo and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    with grpc.insecure_channel(grpc_target(args.host, args.port)) as channel:
        stub = pb_grpc.LLMServiceStub(channel)
        metadata = auth_metadata(args.api_key)
        try:
            if args.info:
                print(stub.ModelInfo(pb.ModelInfoRequest(), timeout=args.timeout or 10.0, metadata=metadata), end="")
                return 0
            start = time.monotonic()
            first = None
            last = None
            generated, prompt_scored = [], []
            for message in stub.Generate(build_request(args), timeout=args.timeout, wait_for_ready=False,
                                         metadata=metadata):
                if first is None and message.token_ids:
                    first = time.monotonic()
                sys.stdout.write(message.text)
                sys.stdout.flush()
                generated.extend(message.logprobs)
                prompt_scored.extend(message.prompt_logprobs)
                last = message
        except grpc.RpcError as e:
            sys.stdout.write("\n")
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # leaving the iteration cancels the call, which frees the server's rBlocks
            sys.stdout.write("\n")
            return 130
    sys.stdout.write("\n")
    if args.prompt_logprobs is not None:
        print(format_logprobs("prompt log-probabilities:", prompt_scored), file=sys.stderr)
    if args.logprobs is not None:
        print(format_logprobs("log-probabilities:", generated), file=sys.stderr)
    if args.usage and last is not None:
        elapsed = time.monotonic() - start
        ttft = f"{(first - start) * 1e3:.0f} ms" if first is not None else "n/a"
        print(f"[{pb.FinishReason.Name(last.finish_reason)}] prompt_tokens={last.usage.prompt_tokens} "
              f"completion_tokens={last.usage.completion_tokens} ttft={ttft} total={elapsed:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
