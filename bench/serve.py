"""The translation server under load, beside the offline translation of the same sentences.

python bench/serve.py --workdir=RUN --sentences=FILE [--clients=32] [--sizes=1,8,64] [--seconds=40] [--rounds=2]

Starts flax-transformer-serve on 127.0.0.1 (a free port) and, in turns for `rounds` rounds: translates every
sentence of FILE offline through the Translator (the engine as translate.py drives it, model loaded in this
process, compiled beforehand), then sends the same sentences to the server from `clients` concurrent clients for
`seconds` seconds (each client sends requests of the `sizes` in turn, taking the file's sentences in order,
round and round). Before the rounds, 10 s of the same load (not measured) compiles what it needs, and
one-sentence requests one at a time measure the idle server's latency.
Prints throughput (sentences/s) of both (the server's: sentences of the requests answered from 5 s after a
round's start to its end, over that time), the ratio, and p50/p95/p99 latency per request size; the last line is one
JSON object. Goals: server throughput at 32 clients ≥ 0.9× offline; a one-sentence request's p99 under load
≤ 3× its p99 on the idle server.
"""

import argparse
import concurrent.futures
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from bench.synthetic import cpu_model  # noqa: E402
from flax_transformer import parallel_text  # noqa: E402


def _free_port() -> int:
  import socket
  with socket.socket() as probe:
    probe.bind(('127.0.0.1', 0))
    return probe.getsockname()[1]


def start_server(workdir: str, port: int) -> subprocess.Popen:
  process = subprocess.Popen([sys.executable, '-m', 'flax_transformer', 'serve', f'--workdir={workdir}',
                              f'--port={port}'], stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 600
  while time.monotonic() < deadline:
    if process.poll() is not None:
      raise SystemExit(f'the server stopped: {process.stderr.read()[-2000:]}')
    try:
      if httpx.get(f'http://127.0.0.1:{port}/ready', timeout=5).status_code == 200:
        return process
    except httpx.HTTPError:
      pass
    time.sleep(0.5)
  process.kill()
  raise SystemExit('the server did not become ready in 10 minutes')


def idle_latency(url: str, sentences: list[str], count: int = 30) -> list[float]:
  seconds = []
  with httpx.Client(base_url=url, timeout=120) as client:
    for sentence in itertools.islice(itertools.cycle(sentences), count):
      start = time.perf_counter()
      client.post('/translate', json={'sentences': [sentence]}).raise_for_status()
      seconds.append(time.perf_counter() - start)
  return seconds


def load(url: str, sentences: list[str], clients: int, sizes: list[int], seconds: float, settle: float = 5.0):
  """(sentences translated per second, {size: [latency, ...]}) of `clients` clients sending for `seconds` seconds:
  the sentences of the requests answered between `settle` seconds after the start and the end, over that time
  (the steady state: neither the first requests' ramp nor the last ones' drain)."""
  position, lock = itertools.count(), threading.Lock()
  latencies = {size: [] for size in sizes}
  answered = []  # (time answered, sentences)
  begin = time.monotonic()
  end = begin + seconds

  def client_loop(number: int):
    with httpx.Client(base_url=url, timeout=600) as client:
      for size in itertools.cycle(sizes[number % len(sizes):] + sizes[:number % len(sizes)]):
        if time.monotonic() >= end:
          return
        with lock:
          first = next(position) * 64
        batch = [sentences[(first + i) % len(sentences)] for i in range(size)]
        start = time.perf_counter()
        response = client.post('/translate', json={'sentences': batch})
        response.raise_for_status()
        with lock:
          latencies[size].append(time.perf_counter() - start)
          answered.append((time.monotonic(), size))
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    list(pool.map(client_loop, range(clients)))
  counted = sum(size for at, size in answered if begin + settle <= at <= end)
  return counted / (seconds - settle), latencies


def percentile(values: list[float], q: float) -> float:
  return float(np.percentile(values, q)) if values else float('nan')


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--sentences', required=True)
  parser.add_argument('--clients', type=int, default=32)
  parser.add_argument('--sizes', default='1,8,64')
  parser.add_argument('--seconds', type=float, default=40)
  parser.add_argument('--rounds', type=int, default=2)
  args = parser.parse_args()
  if args.clients > 256 or args.seconds > 600:
    raise SystemExit('--clients is at most 256 and --seconds at most 600')
  sizes = [int(s) for s in args.sizes.split(',')]
  sentences = [s for s in parallel_text.read_lines(args.sentences) if s.strip()]
  from flax_transformer.translator import Translator
  translator = Translator.from_workdir(args.workdir)
  translator.translate(sentences)  # compiled
  port = _free_port()
  server = start_server(args.workdir, port)
  url = f'http://127.0.0.1:{port}'
  try:
    load(url, sentences, args.clients, sizes, 10)  # every shape the load meets compiled: not measured
    idle = idle_latency(url, sentences)
    offline, served, latencies = [], [], {size: [] for size in sizes}
    for _ in range(args.rounds):
      start = time.perf_counter()
      translator.translate(sentences)
      offline.append(len(sentences) / (time.perf_counter() - start))
      rate, found = load(url, sentences, args.clients, sizes, args.seconds)
      served.append(rate)
      for size, values in found.items():
        latencies[size] += values
  finally:
    server.terminate()
    server.wait(120)
  offline_rate, served_rate = statistics.median(offline), statistics.median(served)
  print(f'{len(sentences)} sentences of {args.sentences}; {cpu_model()}, {os.cpu_count()} cores; {args.clients} '
        f'clients for {args.seconds:g} s a round, requests of {args.sizes} sentences; medians of {args.rounds} '
        f'alternating rounds\n')
  print('| translation | sentences/s | vs offline |\n|---|---:|---:|')
  print(f'| offline (Translator.translate, the engine as translate.py drives it) | {offline_rate:.1f} | 1.00× |')
  print(f'| server, {args.clients} concurrent clients | {served_rate:.1f} | {served_rate / offline_rate:.2f}× |')
  print('\n| request | requests | p50 s | p95 s | p99 s |\n|---|---:|---:|---:|---:|')
  print(f'| 1 sentence, idle server | {len(idle)} | {percentile(idle, 50):.3f} | {percentile(idle, 95):.3f} | '
        f'{percentile(idle, 99):.3f} |')
  for size in sizes:
    values = latencies[size]
    print(f'| {size} sentence(s), under load | {len(values)} | {percentile(values, 50):.3f} | '
          f'{percentile(values, 95):.3f} | {percentile(values, 99):.3f} |')
  one = latencies.get(1, [])
  print(f'\nthroughput {served_rate / offline_rate:.2f}× offline (goal ≥ 0.9×); one-sentence p99 under load '
        f'{percentile(one, 99) / percentile(idle, 99):.2f}× idle (goal ≤ 3×)')
  print(json.dumps({'cpu': cpu_model(), 'offline_sentences_per_second': round(offline_rate, 1),
                    'server_sentences_per_second': round(served_rate, 1),
                    'idle_p99': round(percentile(idle, 99), 4),
                    'p99_by_size': {size: round(percentile(latencies[size], 99), 4) for size in sizes}}))


if __name__ == '__main__':
  main()
