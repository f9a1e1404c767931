"""The HTTP benchmark: one workload against three OpenAI-compatible servers on localhost, one after another.

    python -m bench.serve [--quick] [--concurrency 1 8 16 32] [--max-memory 128MiB] [--level-seconds 150]
                          [--aiperf PATH] [--model DIR]

Servers, each given the same KV budget (`--max-memory`):

    transformers serve                          sequential generate() (DynamicCache: the budget does not apply)
    transformers serve --continuous-batching    transformers' paged continuous batching, --cb-num-blocks from the budget
    hf-paged serve                              the Engine behind transformers' handlers, --max-memory

The model is the embedded benchmark model's sizes (`bench.models.DEFAULT_CONFIG`) with random weights and a 512-token
BPE tokenizer trained here, saved once under `--workdir`; `--model DIR` benchmarks a checkpoint of one's own instead (a
directory `from_pretrained` reads, with a tokenizer and a chat template). Each server gets the same streaming chat
workload from aiperf (PyPI; `make bench-serve` installs it): at each concurrency, `requests_per_concurrency x
concurrency` requests whose prompts share one system prompt, with fixed prompt and output lengths. The table gives
output tok/s, requests/s, TTFT and ITL p50/p99, each server's ratio to hf-paged serve, and the CPU aiperf itself used
(it shares the machine with the server). Before the load, one greedy request to each server checks that all three answer
with the same text.

A full run writes its table into SERVING_LOG.md (the section between `HTTP_BEGIN` and `HTTP_END`, which `python -m
bench` keeps when it rewrites the log) and its plot beside it (`serving_plot_http.png`); a quick run writes
`REPORT.md` and the plot under `--workdir`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.host import host

BLOCK_SIZE = 16
TOKENIZER_VOCAB = 512
HTTP_BEGIN = "<!-- bench.serve: begin -->"
HTTP_END = "<!-- bench.serve: end -->"
PLOT_NAME = "serving_plot_http.png"
GRACE_SECONDS = 30
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class Workload:
    system_prompt_tokens: int = 256
    prompt_tokens: int = 128
    output_tokens: int = 64
    requests_per_concurrency: int = 2  # requests at each concurrency: this many times the concurrency (at least 4)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--max-memory", default="128MiB", help="the KV budget every server gets (default: %(default)s)")
    parser.add_argument(
        "--quick", action="store_true", help="64-token prompts, 16 output tokens, one request per concurrency slot"
    )
    parser.add_argument(
        "--servers", nargs="+", default=["transformers", "transformers-cb", "hf-paged"], help="which servers to run"
    )
    parser.add_argument("--workdir", default="bench/results/serve", help="model, aiperf artifacts and the report")
    parser.add_argument("--aiperf", default=None, help="the aiperf command (default: aiperf beside this Python)")
    parser.add_argument(
        "--level-seconds",
        type=float,
        default=150,
        help="each concurrency level ends after this long (aiperf --benchmark-duration, plus a 30 s grace period "
        "for answers in flight) if its requests have not all finished (default: %(default)s)",
    )
    parser.add_argument("--port", type=int, default=0, help="the servers' port (default: a free one)")
    parser.add_argument(
        "--model", type=Path, default=None, help="a checkpoint directory to serve (default: the embedded model)"
    )
    parser.add_argument(
        "--log", default="SERVING_LOG.md", help="the log a full run writes its section into (default: %(default)s)"
    )
    return parser.parse_args(argv)


def save_model(model_dir: Path) -> Path:
    """The embedded benchmark model's sizes, random weights (seed 0), and a BPE tokenizer of TOKENIZER_VOCAB tokens."""
    if (model_dir / "config.json").exists():
        return model_dir
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from bench.models import DEFAULT_CONFIG

    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    corpus = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(400)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|pad|>", eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(**{**DEFAULT_CONFIG, "vocab_size": len(fast), "bos_token_id": None})
    model = LlamaForCausalLM(config)
    model_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(model_dir)
    model.save_pretrained(model_dir)
    return model_dir


def model_directory(args, workdir: Path) -> Path:
    """`--model`, checked (a directory with a config and a tokenizer), else the embedded model saved under `workdir`."""
    if args.model is None:
        return save_model(workdir / "model")
    model_dir = Path(args.model)
    missing = [name for name in ("config.json", "tokenizer_config.json") if not (model_dir / name).is_file()]
    if missing:
        raise SystemExit(f"--model {model_dir}: not a checkpoint directory (no {' or '.join(missing)})")
    return model_dir.resolve()


def num_blocks_for(model_dir: Path, max_memory: str) -> int:
    """Blocks of BLOCK_SIZE tokens the KV budget buys for this model (what hf-paged serve's pool gets)."""
    from transformers import AutoConfig

    from hf_paged import BlockPool

    config = AutoConfig.from_pretrained(model_dir)
    return BlockPool.for_model(config, max_memory=max_memory, block_size=BLOCK_SIZE, device="meta").num_blocks


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(name: str, model_dir: Path, port: int, max_memory: str, num_blocks: int) -> list[str]:
    bin_dir = Path(sys.executable).parent
    where = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "hf-paged":
        return [sys.executable, "-m", "hf_paged", "serve", str(model_dir), *where, "--max-memory", max_memory]
    command = [str(bin_dir / "transformers"), "serve", str(model_dir), *where, "--device", "cpu"]
    if name == "transformers-cb":
        command += ["--continuous-batching", "--cb-num-blocks", str(num_blocks), "--cb-block-size", str(BLOCK_SIZE)]
    return command


class Server:
    """A server in a subprocess on 127.0.0.1, stopped by its process id."""

    def __init__(self, command: list[str], port: int, log_path: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        with open(log_path, "w") as log:
            env = {**os.environ, "HF_HUB_OFFLINE": "1"}
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, model_dir: Path, timeout_s: float = 300) -> None:
        """Until a one-token completion answers (the first request loads the model on `transformers serve`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}); see {self.log_path}")
            try:
                self.complete(model_dir, "ready", 1)
                return
            except (OSError, urllib.error.URLError):
                time.sleep(0.5)
        raise RuntimeError(f"the server did not answer in {timeout_s} s; see {self.log_path}")

    def complete(self, model_dir: Path, prompt: str, max_tokens: int) -> str:
        body = {
            "model": str(model_dir),
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)["choices"][0]["message"]["content"]

    def rss_mib(self) -> float | None:
        """The server process's resident memory (Linux /proc), MiB."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
        return None if kib is None else kib / 1024

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()


def aiperf_command(args, model_dir: Path, url: str, concurrency: int, workload: Workload, out_dir: Path) -> list[str]:
    aiperf = args.aiperf or str(Path(sys.executable).parent / "aiperf")
    num_requests = max(workload.requests_per_concurrency * concurrency, 4)
    return [
        aiperf,
        "profile",
        "--model",
        str(model_dir),
        "--tokenizer",
        str(model_dir),
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(num_requests),
        "--synthetic-input-tokens-mean",
        str(workload.prompt_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(workload.output_tokens),
        "--output-tokens-stddev",
        "0",
        "--shared-system-prompt-length",
        str(workload.system_prompt_tokens),
        "--random-seed",
        "0",
        "--artifact-dir",
        str(out_dir),
        "--benchmark-duration",
        str(args.level_seconds),
        "--benchmark-grace-period",
        str(GRACE_SECONDS),
        "--ui-type",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]


def run_aiperf(command: list[str], out_dir: Path) -> dict:
    """Run aiperf; returns its summary and the CPU seconds it used."""
    out_dir.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}  # aiperf: see DESIGN.md
    with open(out_dir / "aiperf.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    summary = json.loads(next(out_dir.rglob("profile_export_aiperf.json")).read_text())
    return {"summary": summary, "aiperf_cpu_s": cpu, "wall_s": wall}


def metric(summary: dict, name: str, stat: str) -> float | None:
    entry = summary.get(name)
    if entry is None:
        entry = next((m for m in summary.get("records", []) if m.get("tag") == name), None)
    if not isinstance(entry, dict):
        return None
    value = entry.get(stat)
    return float(value) if value is not None else None


def row_of(server: str, concurrency: int, result: dict) -> dict:
    summary = result["summary"]
    return {
        "server": server,
        "concurrency": concurrency,
        "output_tok_s": metric(summary, "output_token_throughput", "avg"),
        "requests_s": metric(summary, "request_throughput", "avg"),
        "ttft_p50_ms": metric(summary, "time_to_first_token", "p50"),
        "ttft_p99_ms": metric(summary, "time_to_first_token", "p99"),
        "itl_p50_ms": metric(summary, "inter_token_latency", "p50"),
        "itl_p99_ms": metric(summary, "inter_token_latency", "p99"),
        "aiperf_cpu": result["aiperf_cpu_s"] / result["wall_s"],
    }


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(
    rows: list[dict], args, workload: Workload, num_blocks: int, greedy: dict[str, str], plot: str | None
) -> str:
    lines = [
        "## HTTP serving: transformers serve vs hf-paged serve",
        "",
        f"- command: `python -m bench.serve{' --quick' if args.quick else ''} --concurrency "
        f"{' '.join(map(str, args.concurrency))} --max-memory {args.max_memory} "
        f"--level-seconds {args.level_seconds:g}"
        f"{f' --model {args.model}' if getattr(args, 'model', None) else ''}`",
        f"- machine: `{host()}`",
        f"- date: `{time.strftime('%Y-%m-%d', time.gmtime())}`",
        "",
        f"KV budget {args.max_memory} ({num_blocks} blocks of {BLOCK_SIZE} tokens for the continuous-batching "
        f"servers); streaming chat, {workload.system_prompt_tokens}-token shared system prompt + "
        f"{workload.prompt_tokens}-token prompts, {workload.output_tokens} output tokens; aiperf, "
        f"{workload.requests_per_concurrency} x concurrency requests per level, or what finishes in "
        f"{args.level_seconds:g} s (+{GRACE_SECONDS} s for answers in flight; a slow server's queued requests then "
        "never count in its TTFT); the servers run one after another. aiperf counts output tokens by tokenizing the "
        "text it gets back, the same way for every server (with random weights that is more tokens than the "
        "server generated). Ratios from the same run: hf-paged serve's output tok/s over that server's, and that "
        "server's TTFT p99 over hf-paged serve's (above 1: hf-paged answers sooner). aiperf CPU: the cores the "
        "load generator itself used on the same machine, averaged over its run. "
        "Server RSS: the server process's resident memory after the level (the levels run in order on one process).",
        "",
        "| server | concurrency | output tok/s | requests/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| aiperf CPU (cores) | server RSS MiB | hf-paged tok/s ratio | TTFT p99 ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    paged = {row["concurrency"]: row for row in rows if row["server"] == "hf-paged"}
    for row in rows:
        ours = paged.get(row["concurrency"]) or {}
        lines.append(
            f"| {row['server']} | {row['concurrency']} | {fmt(row['output_tok_s'])} | {fmt(row['requests_s'], 2)} "
            f"| {fmt(row['ttft_p50_ms'])} | {fmt(row['ttft_p99_ms'])} | {fmt(row['itl_p50_ms'])} "
            f"| {fmt(row['itl_p99_ms'])} | {fmt(row['aiperf_cpu'], 2)} | {fmt(row.get('rss_mib'), 0)} "
            f"| {fmt(ratio(ours.get('output_tok_s'), row['output_tok_s']), 2)}x "
            f"| {fmt(ratio(row['ttft_p99_ms'], ours.get('ttft_p99_ms')), 2)}x |"
        )
    texts = set(greedy.values())
    lines += ["", f"Greedy answer to one prompt: {'identical on every server' if len(texts) == 1 else 'DIFFERS'}."]
    if len(texts) > 1:
        lines += [f"- {server}: {text!r}" for server, text in greedy.items()]
    if plot is not None:
        lines += ["", f"![HTTP serving: output tok/s, TTFT p99 and ITL p50 against concurrency]({plot})"]
    return "\n".join(lines) + "\n"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def with_section(log: str, section: str) -> str:
    """`log` with its HTTP section (between HTTP_BEGIN and HTTP_END) replaced by `section`, or `section` appended."""
    block = f"{HTTP_BEGIN}\n{section.rstrip()}\n{HTTP_END}\n"
    if HTTP_BEGIN in log and HTTP_END in log:
        start, end = log.index(HTTP_BEGIN), log.index(HTTP_END) + len(HTTP_END)
        return log[:start] + block.rstrip("\n") + log[end:]
    return log.rstrip("\n") + "\n\n" + block


def http_section(log: str) -> str | None:
    """The HTTP section of `log` without its markers, or None."""
    if HTTP_BEGIN not in log or HTTP_END not in log:
        return None
    return log[log.index(HTTP_BEGIN) + len(HTTP_BEGIN) : log.index(HTTP_END)].strip("\n") + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    workload = Workload(prompt_tokens=64, output_tokens=16, requests_per_concurrency=1) if args.quick else Workload()
    workdir = Path(args.workdir)
    model_dir = model_directory(args, workdir)
    num_blocks = num_blocks_for(model_dir, args.max_memory)
    rows, greedy = [], {}
    for name in args.servers:
        port = args.port or free_port()
        server = Server(
            server_command(name, model_dir, port, args.max_memory, num_blocks), port, workdir / f"{name}.log"
        )
        try:
            server.wait_ready(model_dir)
            greedy[name] = server.complete(model_dir, "the a of to and in is that", 16)
            for concurrency in args.concurrency:
                out_dir = workdir / "aiperf" / f"{name}-c{concurrency}"
                shutil.rmtree(out_dir, ignore_errors=True)
                command = aiperf_command(args, model_dir, server.url, concurrency, workload, out_dir)
                rows.append({**row_of(name, concurrency, run_aiperf(command, out_dir)), "rss_mib": server.rss_mib()})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            server.stop()
    from bench.plot import plot_http

    if args.quick:
        plot = plot_http(rows, workdir / PLOT_NAME, title="HTTP serving, quick run")
        report = render(rows, args, workload, num_blocks, greedy, plot and PLOT_NAME)
        (workdir / "REPORT.md").write_text(report)
    else:
        log = Path(args.log)
        plot = plot_http(rows, log.parent / PLOT_NAME, title="HTTP serving")
        report = render(rows, args, workload, num_blocks, greedy, plot and PLOT_NAME)
        log.write_text(with_section(log.read_text() if log.exists() else "", report))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
