"""A long-running `hf-paged serve`: waves of mixed requests against one server, its resident memory after each.

    python -m bench.serve_soak [--waves 20] [--wave-size 64] [--max-memory 128MiB]

Each wave sends `--wave-size` requests at once to one server (the benchmark model of `bench.serve`): streaming chat
completions behind a shared system prompt with per-request seeds and lengths, some whose client disconnects after a
few tokens, some refused (a bad temperature), some non-streaming completions. After the wave, the server must come
back to no running request and no used block (`/metrics`); the table gives its resident memory then. Memory that
stays flat over the waves, after the first has warmed the allocator and the gather buffers up, is what a server
that runs for days needs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from pathlib import Path

from bench.serve import Server, free_port, save_model, server_command


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--waves", type=int, default=20)
    parser.add_argument("--wave-size", type=int, default=64)
    parser.add_argument("--max-memory", default="128MiB")
    parser.add_argument("--workdir", default="bench/results/serve")
    return parser.parse_args(argv)


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {name: float(value) for name, value in (line.split() for line in text.splitlines() if line[:1] != "#")}


async def one_request(client, model: str, kind: str, rng: random.Random) -> str:
    import openai

    system = "you are a helpful assistant " * 24  # the shared system prompt
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {rng.random()}"}]
    try:
        if kind == "refused":
            await client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=-1)
        elif kind == "plain":
            await client.completions.create(model=model, prompt=f"say {rng.random()}", max_tokens=rng.randint(1, 24))
        else:
            stream = await client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=rng.randint(4, 32),
                temperature=1.0,
                seed=rng.randrange(1 << 30),
                stream=True,
            )
            async for index, _chunk in _enumerate(stream):
                if kind == "disconnect" and index == 3:
                    await stream.close()  # the client goes away mid-stream
                    break
    except openai.BadRequestError:
        return "refused"
    return kind


async def _enumerate(stream):
    index = 0
    async for chunk in stream:
        yield index, chunk
        index += 1


async def wave(url: str, model: str, size: int, rng: random.Random) -> dict[str, int]:
    import openai

    kinds = rng.choices(["stream", "disconnect", "refused", "plain"], weights=[10, 2, 1, 3], k=size)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        done = await asyncio.gather(*(one_request(client, model, kind, rng) for kind in kinds))
    return {kind: done.count(kind) for kind in sorted(set(done))}


def wait_idle(url: str, timeout_s: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        now = metrics(url)
        if now["hf_paged_requests_running"] == now["hf_paged_kv_blocks_used"] == 0 or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir)
    model_dir = save_model(workdir / "model")
    port = free_port()
    server = Server(server_command("hf-paged", model_dir, port, args.max_memory, 0), port, workdir / "soak.log")
    rng = random.Random(0)
    rows = []
    try:
        server.wait_ready(model_dir)
        for number in range(1, args.waves + 1):
            start = time.perf_counter()
            kinds = asyncio.run(wave(server.url, str(model_dir), args.wave_size, rng))
            idle = wait_idle(server.url)
            rows.append(
                {
                    "wave": number,
                    "seconds": round(time.perf_counter() - start, 1),
                    **kinds,
                    "running": idle["hf_paged_requests_running"],
                    "blocks_used": idle["hf_paged_kv_blocks_used"],
                    "rss_mib": round(server.rss_mib() or 0, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    settled = [row["rss_mib"] for row in rows[1:]] or [rows[0]["rss_mib"]]
    print(
        f"{sum(args.wave_size for _ in rows)} requests in {len(rows)} waves; RSS after wave 1: {rows[0]['rss_mib']} "
        f"MiB; over waves 2-{len(rows)}: {min(settled)} to {max(settled)} MiB (last {rows[-1]['rss_mib']}); every "
        f"wave ended with {max(row['running'] for row in rows):g} running and "
        f"{max(row['blocks_used'] for row in rows):g} used blocks"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
