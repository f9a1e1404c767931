"""`hf-paged serve MODEL`: an OpenAI-compatible server (transformers' own) with the hf-paged Engine generating."""

from __future__ import annotations

import argparse
import gc
import sys

from ..errors import ServeUnavailable


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", help="a local directory holding the model and its tokenizer (from save_pretrained)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument(
        "--max-memory",
        default="1GiB",
        help="the KV cache pool's size: bytes, or K/M/G/T and Ki/Mi/Gi/Ti sizes such as 2GiB (default: %(default)s)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once (default: %(default)s)")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens per Engine step, at least --max-num-seqs (default: %(default)s)",
    )
    parser.add_argument(
        "--decode-reserve-tokens",
        type=int,
        default=256,
        help="how far admission looks ahead for each running request's growth: more admits fewer requests at once, "
        "fewer preempts (and recomputes) more often when requests run long (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key", default=None, help="answer /v1/ requests only with this bearer key (default: none)"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model name requests use (default: MODEL as given)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the most tokens of one request, prompt and generated (default: the model's position limit)",
    )
    parser.add_argument("--dtype", default="auto", help="model dtype: auto (from the weights), bfloat16, float32, ...")
    parser.add_argument("--device", default=None, help="cuda, cuda:1, cpu, ... (default: cuda when present, else cpu)")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the Engine's forwards at startup (CUDA only; tens of seconds for a 1B model), for faster "
        "steps after",
    )
    parser.add_argument(
        "--log-level", default="warning", choices=("debug", "info", "warning", "error"), help="(default: %(default)s)"
    )
    return parser


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line before anything loads (a missing model directory, a device that is not
    there, a size below 1), or None."""
    import os

    import torch

    if not os.path.isdir(args.model):
        return f"no model directory at {args.model!r}: MODEL is a local directory written by save_pretrained"
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {value}"
    if args.decode_reserve_tokens < 0:
        return f"--decode-reserve-tokens must be at least 0, got {args.decode_reserve_tokens}"
    device_type = default_device()
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError as error:
            return f"--device {args.device!r} is not a device: {error}"
        device_type = device.type
        if device.type == "cuda":
            count = torch.cuda.device_count()
            if device.index is not None and device.index >= count or count == 0:
                return f"--device {args.device}: this machine has {count} CUDA device{'s' * (count != 1)}"
    if args.compile and device_type != "cuda":
        return f"--compile needs a CUDA device (its compiled forwards run the Triton kernels), got {device_type}"
    return None


def freeze_startup_heap() -> int:
    """Move every object alive now (torch, transformers, the model, the Engine: the server's startup heap, which lives
    as long as it does) out of the garbage collector's sight, after one last collection; returns how many were
    frozen. A full collection then walks only what the server made since, instead of pausing every stream for the
    whole heap (about 390,000 objects, 180-195 ms a collection on a 2-core CPU with the embedded model)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve(args: argparse.Namespace) -> None:
    from .compat import check_seams

    problem = check_args(args)
    if problem is not None:
        sys.exit(f"hf-paged serve: {problem}")

    try:
        check_seams()
    except ServeUnavailable as error:
        sys.exit(f"hf-paged serve: {error}")

    import uvicorn
    from transformers.utils import logging as transformers_logging

    from .app import ServeConfig, build_app

    if args.log_level == "warning":  # transformers' handlers log every request at warning level
        transformers_logging.set_verbosity_error()
    config = ServeConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        max_memory=args.max_memory,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_reserve_tokens=args.decode_reserve_tokens,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        device=args.device or default_device(),
        compile=args.compile,
    )
    if config.device.startswith("cuda"):  # build_app warms the Engine up there (`engine/warm_up.py`)
        what = "its kernels and forwards (--compile)" if config.compile else "its kernels"
        print(f"hf-paged serve: loading {config.model}; the Engine compiles {what} before it serves", flush=True)
    try:
        app, manager = build_app(config)
    except (OSError, ValueError, NotImplementedError) as error:  # no such model, a pool too large, a model refused
        sys.exit(f"hf-paged serve: cannot serve {config.model}: {error}")
    freeze_startup_heap()
    print(f"hf-paged serve: {config.model} on http://{config.host}:{config.port}/v1", flush=True)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        manager.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hf-paged", description="hf-paged: a paged KV cache for transformers")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser(commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API"))
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args)
