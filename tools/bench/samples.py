"""`specstream bench samples`: ``n`` = 4 samples of one prompt in one request, against 4 requests.

One prompt (the agent system prompt of tools/bench/prefix.py, ~1,040 tokens, and a request), 4
sampled answers of up to ``MAX_NEW_TOKENS`` tokens at temperature 0.8, over the OpenAI HTTP API
(the `openai` client) on the default pair (speculation auto, the three processes):

- **n = 4**: one request with ``n=4`` (the gateway sends its 4 choices together; the target
  prefills the prompt once and the other three fork it);
- **4 requests at once**: 4 requests with ``n=1``, sent together from 4 threads (the same
  sharing applies: the target sees 4 prompts that start alike arrive together);
- **4 requests in a row**: the same 4 requests, each sent when the one before has answered (the
  last three start from the first's prompt in the prefix cache);
- **4 requests in a row, nothing shared**: the same, each under a salt of its own (4 prefills).

Each run has a cache salt of its own, so every row starts cold (nothing cached from a run
before). Per row: the wall time of the 4 answers (the fastest of ``REPEATS`` runs), the generated
tokens per second, and the ratios to the two rows of 4 requests in a row. Prints a table, writes
``samples.json`` and ``samples.png``.
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from tools.bench import report
from tools.bench.latency import display
from tools.bench.models import BenchModels
from tools.bench.prefix import AGENT_REQUESTS, AGENT_SYSTEM
from tools.launcher import Stack, StackSpec
from tools.progress import Progress

__all__ = ["run"]

N = 4
MAX_NEW_TOKENS = 64
REPEATS = 3
ROWS = ("n = 4", "4 requests at once", "4 requests in a row", "4 requests in a row, nothing shared")
HEADERS = ["row", "seconds (best)", "tok/s", "vs in a row", "vs nothing shared"]


def run(models: BenchModels, out_dir: Path, quiet: bool = False) -> dict:
    import openai

    spec = StackSpec(**models.stack_fields(), http_port=0)
    messages = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": AGENT_REQUESTS[0]}]
    runs: dict[str, list[dict]] = {row: [] for row in ROWS}
    with tempfile.TemporaryDirectory() as logs, Stack(replace(spec, log_dir=logs)) as stack, \
            openai.OpenAI(base_url=f"http://{stack.http_address}/v1", api_key="none", max_retries=0,
                          timeout=600) as client, ThreadPoolExecutor(N) as pool, \
            Progress(len(ROWS) * REPEATS, "runs", "samples", quiet=quiet) as progress:
        model = client.models.list().data[0].id

        def ask(salt: str, n: int, seed: int):
            return client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_NEW_TOKENS,
                                                  temperature=0.8, n=n, seed=seed,
                                                  extra_body={"cache_salt": salt})

        ask("warm-up", 1, 0)  # not timed
        for repeat in range(REPEATS):
            for row in ROWS:
                salt = f"{row} {repeat}"  # cold: nothing of an earlier run is cached
                started = time.perf_counter()
                if row == "n = 4":
                    answers = [ask(salt, N, 100)]
                elif row == "4 requests at once":
                    answers = list(pool.map(lambda i: ask(salt, 1, 100 + i), range(N)))
                elif row == "4 requests in a row":
                    answers = [ask(salt, 1, 100 + i) for i in range(N)]
                else:
                    answers = [ask(f"{salt} {i}", 1, 100 + i) for i in range(N)]
                seconds = time.perf_counter() - started
                tokens = sum(a.usage.completion_tokens for a in answers)
                runs[row].append({"seconds": seconds, "tokens": tokens,
                                  "texts": [c.message.content for a in answers for c in a.choices]})
                progress.update()
    best = {row: min(runs[row], key=lambda r: r["seconds"]) for row in ROWS}
    base, alone = best["4 requests in a row"], best["4 requests in a row, nothing shared"]
    rows = []
    data = {"models": models.label, "target": display(models.target), "cpu": report.cpu_name(), "n": N,
            "max_new_tokens": MAX_NEW_TOKENS, "repeats": REPEATS, "rows": {}}
    for row in ROWS:
        r = best[row]
        tps = r["tokens"] / r["seconds"]
        ratio = tps / (base["tokens"] / base["seconds"])
        apart = tps / (alone["tokens"] / alone["seconds"])
        rows.append([row, r["seconds"], tps, ratio, apart])
        data["rows"][row] = {"seconds": r["seconds"], "tokens": r["tokens"], "tokens_per_s": tps,
                             "vs_in_a_row": ratio, "vs_nothing_shared": apart,
                             "all_seconds": [x["seconds"] for x in runs[row]]}
    print(f"samples, {models.label} on {data['cpu']}: {N} answers of up to {MAX_NEW_TOKENS} tokens to one "
          f"~1,060-token prompt, temperature 0.8, the fastest of {REPEATS} runs")
    print(report.table(HEADERS, rows))
    data["table_markdown"] = report.markdown_table(HEADERS, rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(out_dir / "samples.json", data)
    report.plot_bars(out_dir / "samples.png", f"{N} samples of one prompt, tokens per second, {models.label} "
                     f"({data['cpu']})", "tok/s", {row: data["rows"][row]["tokens_per_s"] for row in ROWS})
    return data
