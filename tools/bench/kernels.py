"""`specstream bench kernels`: the output layer, fused kernels against unfused torch, on this device.

For each vocabulary size, row count and hidden size (bfloat16 weights and hidden states) it times,
as the median of repeated runs:

- unfused torch, as a serving stack without fused kernels runs it: ``hidden @ W.T`` (+ bias), then
  argmax and log-softmax (1-best with its log-probability), or softmax at T and ``multinomial``
  (sampling);
- the fused ops (kernels/): ``best_token`` and ``sample`` reading the hidden states with the head
  (``Hidden``), so [rows, vocab] logits are never written — on CUDA only: on a CPU the Triton
  kernels run in the interpreter, which checks their results, not their speed;
- with a model (the served target), the share of one decode step spent in the output layer
  (Marian's table: the forward up to the final norm against the head + 1-best).

Prints tables and writes ``kernels.json`` and ``kernels.png`` (fused ÷ unfused per size, on CUDA;
the unfused output layer's time per row count otherwise). The device is named in the output.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path

import torch

from specstream.serving.compute import on_torch_thread  # the thread the engine runs torch on (its settings)
from tools.bench import report
from tools.progress import Progress

VOCABS = (32_000, 49_152, 128_256, 151_936)
ROWS = (1, 8, 64, 576)
HIDDENS = (576, 2048, 4096)
# On a CPU the largest sizes take minutes per call (a 576 x 152k x 4096 GEMM); these run by default.
CPU_ROWS = (1, 8, 64)
CPU_HIDDENS = (576,)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, budget_s: float = 2.0) -> float:
    fn()  # warm-up (and compilation, for a Triton kernel)
    _sync(device)
    times: list[float] = []
    started = time.perf_counter()
    # At least 3 calls, then until 50 or the budget: a call of seconds (a slow kernel on a large
    # size) is timed 3 times, not 5.
    while len(times) < 3 or (len(times) < 50 and time.perf_counter() - started < budget_s):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


@functools.lru_cache(maxsize=1)
def _head(vocab: int, hidden: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random output layer, drawn on the device (a 152k x 4096 one takes seconds to draw on a CPU)
    and kept for the next row count of the same size."""
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=gen, device=device) * hidden ** -0.5).to(torch.bfloat16)  # [V, H]
    bias = torch.randn(vocab, generator=gen, device=device).to(torch.bfloat16)  # [V]
    return weight, bias


@torch.inference_mode()
def output_layer(vocab: int, rows: int, hidden: int, device: torch.device, fused: bool) -> dict[str, float]:
    """ms per output-layer call at one size: unfused torch, and the fused ops when ``fused``."""
    import kernels
    from kernels.random import row_keys

    weight, bias = _head(vocab, hidden, device)
    gen = torch.Generator(device=device).manual_seed(0)
    states = torch.randn(rows, hidden, generator=gen, device=device).to(torch.bfloat16)  # [R, H]
    temperature = torch.full((rows,), 0.8, device=device)
    keys = row_keys(range(rows), [0] * rows, 3, device)

    def unfused_best():
        logits = torch.nn.functional.linear(states, weight, bias).float()  # [R, V]
        ids = logits.argmax(dim=-1)
        return ids, torch.log_softmax(logits, dim=-1).gather(1, ids[:, None])

    def unfused_sample():
        logits = torch.nn.functional.linear(states, weight, bias).float()  # [R, V]
        return torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1)

    out = {"unfused 1-best + logprob": _median_ms(unfused_best, device),
           "unfused sample": _median_ms(unfused_sample, device)}
    if fused:
        scores = kernels.Hidden(states, kernels.OutputHead(weight, bias))
        with kernels.use("triton"):
            out["fused 1-best + logprob"] = _median_ms(lambda: kernels.best_token(scores, logprob=True), device)
            out["fused sample"] = _median_ms(lambda: kernels.sample(scores, temperature, keys), device)
    return out


@torch.inference_mode()
def verification(vocab: int, sequences: int, gamma: int, device: torch.device) -> dict[str, float]:
    """The fused speculative verification over logits [sequences, γ+1, vocab] bf16 (every row read
    once): ms, the bytes it must read, and the time a read-and-write copy of those bytes takes on
    this device (the memory-bandwidth bound, measured rather than taken from a data sheet)."""
    import kernels
    from kernels.random import ACCEPT, row_keys, uniforms

    gen = torch.Generator(device="cpu").manual_seed(1)
    logits = (torch.randn(sequences, gamma + 1, vocab, generator=gen) * 2).to(device, torch.bfloat16)
    width = 8
    q_ids = torch.randint(0, vocab, (sequences, gamma, width), generator=gen).to(device)
    q_probs = torch.full((sequences, gamma, width), 1.0 / width, device=device)
    draft = q_ids[..., 0].contiguous()
    num_draft = torch.full((sequences,), gamma, device=device)
    temperature = torch.ones(sequences, device=device)
    threshold = torch.full((sequences, gamma + 1), float("-inf"), device=device)
    keys = torch.stack([row_keys(range(sequences), [j] * sequences, 3, device) for j in range(gamma + 1)], dim=1)
    u_accept = uniforms(range(sequences), [0] * sequences, gamma, ACCEPT, device)
    with kernels.use("triton"):
        ms = _median_ms(lambda: kernels.speculative_verify_fused(logits, q_ids, q_probs, draft, num_draft, temperature,
                                                                 threshold, keys, u_accept), device)
    copy_ms = _median_ms(lambda: logits.clone(), device) / 2  # a clone reads and writes: half is the read
    return {"ms": ms, "bytes": logits.numel() * logits.element_size(), "read bound ms": copy_ms}


@torch.inference_mode()
def step_share(model, rows: int, device: torch.device, fused: bool) -> dict[str, float]:
    """ms of one decode step over ``rows`` sequences (200 cached tokens each): the forward up to
    the final norm, and the output layer + 1-best after it (unfused torch; fused when ``fused``)."""
    import kernels

    context = 200
    cache = model.new_cache(rows, context + 2)
    slots = torch.tensor([cache.alloc() for _ in range(rows)])
    model.hidden(torch.zeros(rows, context, dtype=torch.int64, device=device), cache, slots,
                 torch.zeros(rows, dtype=torch.int64))  # fill the context
    ids = torch.full((rows, 1), 100, dtype=torch.int64, device=device)
    start = torch.full((rows,), context, dtype=torch.int64)
    hidden = model.hidden(ids, cache, slots, start)[:, 0]  # [R, H]
    head = model.output_head
    out = {"layers": _median_ms(lambda: model.hidden(ids, cache, slots, start), device),
           "output layer, unfused": _median_ms(lambda: head.logits(hidden).argmax(dim=-1), device)}
    if fused:
        with kernels.use("triton"):
            out["output layer, fused"] = _median_ms(lambda: kernels.best_token(kernels.Hidden(hidden, head)), device)
    return out


def run(out_dir: Path, device: str | None = None, vocabs=VOCABS, rows=None, hiddens=None, models=None,
        fused: bool | None = None, verify_shape: tuple[int, int] = (64, 8), quiet: bool = False) -> dict:
    """``fused`` (default: on CUDA with Triton) also times the Triton ops; forced on a CPU it runs
    them interpreted (to exercise this code in tests: the timings then mean nothing).
    ``verify_shape``: (sequences, γ) of the verification timing. Progress on stderr
    (tools.progress; ``quiet``: plain lines, never a bar), counted in measurements: one
    per size, per verification, per decode step."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from kernels.dispatch import triton_available

    fused = (dev.type == "cuda" and triton_available()) if fused is None else fused
    rows = rows or (ROWS if dev.type == "cuda" else CPU_ROWS)
    hiddens = hiddens or (HIDDENS if dev.type == "cuda" else CPU_HIDDENS)
    data: dict = {"device": device_name(dev), "dtype": "bfloat16", "fused_measured": fused, "sizes": [], "steps": {},
                  "verification": []}
    print(f"device: {data['device']}" + ("" if fused else "  (fused kernels: not timed here, see the docstring)"))
    steps = [n for n in rows if n <= 64] if models is not None else []
    total = len(hiddens) * len(vocabs) * len(rows) + (len(vocabs) if fused else 0) + len(steps)
    with Progress(total, "measurements", "kernels: output layer", quiet=quiet) as progress:
        _output_layers(data, out_dir, dev, vocabs, rows, hiddens, fused, progress)
        if fused:
            progress.phase("kernels: fused verification")
            sequences, gamma = verify_shape
            for vocab in vocabs:
                timing = on_torch_thread(verification, vocab, sequences, gamma, dev)
                data["verification"].append({"vocab": vocab, "sequences": sequences, "gamma": gamma, **timing})
                progress.update()
        if models is not None:
            progress.phase("kernels: a decode step's share")
            model = models.load("target")
            data["weights"] = model.weights
            for n in steps:
                data["steps"][str(n)] = on_torch_thread(step_share, model, n, dev, fused)
                progress.update()
            data["model"] = models.label
    report.write_json(out_dir / "kernels.json", data)
    print(tables(data))
    _plot(data, out_dir)
    return data


def _output_layers(data: dict, out_dir: Path, dev: torch.device, vocabs, rows, hiddens, fused: bool,
                   progress: Progress) -> None:
    """Times the output layer at every size (`output_layer`), printing each and saving ``kernels.json`` as it goes."""
    for hidden in hiddens:
        for vocab in vocabs:
            for n in rows:
                times = on_torch_thread(output_layer, vocab, n, hidden, dev, fused)
                data["sizes"].append({"vocab": vocab, "rows": n, "hidden": hidden, "ms": times})
                progress.update()
                progress.print(f"V={vocab:>6} rows={n:>3} H={hidden:>4}  "
                               + "  ".join(f"{k} {v:8.3f} ms" for k, v in times.items()))
                report.write_json(out_dir / "kernels.json", data)


def tables(data: dict, markdown: bool = False) -> str:
    fmt = report.markdown_table if markdown else report.table
    ops = list(data["sizes"][0]["ms"]) if data["sizes"] else []
    rows = [[s["vocab"], s["rows"], s["hidden"], *[f"{s['ms'][op]:.3f}" for op in ops],
             *([f"{s['ms']['unfused 1-best + logprob'] / s['ms']['fused 1-best + logprob']:.2f}",
                f"{s['ms']['unfused sample'] / s['ms']['fused sample']:.2f}"] if data["fused_measured"] else [])]
            for s in data["sizes"]]
    headers = ["vocab", "rows", "hidden", *[f"{op} (ms)" for op in ops],
               *(["1-best: unfused ÷ fused", "sample: unfused ÷ fused"] if data["fused_measured"] else [])]
    out = [f"output layer, {data['dtype']}, {data['device']}\n" + fmt(headers, rows)]
    if data["steps"]:
        step_rows = []
        for n, t in data["steps"].items():
            total = t["layers"] + t["output layer, unfused"]
            row = [n, f"{t['layers']:.2f}", f"{t['output layer, unfused']:.2f}",
                   f"{100 * t['output layer, unfused'] / total:.0f}%"]
            if "output layer, fused" in t:
                fused_total = t["layers"] + t["output layer, fused"]
                row += [f"{t['output layer, fused']:.2f}", f"{100 * t['output layer, fused'] / fused_total:.0f}%"]
            step_rows.append(row)
        headers = ["rows", "layers (ms)", "output layer, unfused (ms)", "share"]
        if data["fused_measured"]:
            headers += ["output layer, fused (ms)", "share"]
        out.append(f"one decode step of {data.get('model', 'the target')} ({data.get('weights', '')} weights)\n"
                   + fmt(headers, step_rows))
    if data.get("verification"):
        rows = [[v["vocab"], f"{v['sequences']} x {v['gamma'] + 1}", f"{v['bytes'] / 1e6:.1f}", f"{v['ms']:.3f}",
                 f"{v['read bound ms']:.3f}", f"{v['ms'] / v['read bound ms']:.2f}"] for v in data["verification"]]
        out.append("fused speculative verification (logits in bfloat16)\n"
                   + fmt(["vocab", "rows", "MB read", "ms", "read bound ms", "÷ bound (target ≤ 2)"], rows))
    return "\n\n".join(out)


def _plot(data: dict, out_dir: Path) -> None:
    if data["fused_measured"]:
        bars = {f"V{s['vocab'] // 1000}k r{s['rows']} H{s['hidden']}":
                s["ms"]["unfused 1-best + logprob"] / s["ms"]["fused 1-best + logprob"] for s in data["sizes"]}
        report.plot_bars(out_dir / "kernels.png", f"1-best output layer: unfused ÷ fused ({data['device']})",
                         "speed-up", bars)
    else:
        bars = {f"V{s['vocab'] // 1000}k r{s['rows']} H{s['hidden']}": s["ms"]["unfused 1-best + logprob"]
                for s in data["sizes"]}
        report.plot_bars(out_dir / "kernels.png", f"unfused output layer, 1-best ({data['device']})", "ms", bars)
