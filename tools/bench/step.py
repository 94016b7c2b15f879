"""`specstream bench step`: one decode step against the machine's limit, and what a verify costs.

On a memory-bound device a decode step costs the bytes it reads over the memory bandwidth, so this
benchmark measures, in one run:

- the bytes a 1-token step of the served target reads: every weight of every layer and the output
  layer as the model holds them (4-bit blocks, int8 blocks or dense), plus the KV cache it attends
  over at the run's context;
- the read bandwidth, by a probe (a sum over a buffer far larger than the last-level cache, with
  the model's thread count), and so the bound: bytes ÷ bandwidth;
- the 1-token step and a verify over 2, 4, 8 and 16 positions, as multiples of the step (the
  targets: 1.05, 1.10, 1.25, 1.6); the same with each layer run op by op instead of as one native
  call (models/llama.py, ``FUSED_LAYERS``), and with the 4-bit matrices on ATen's int4 kernel (the
  matmul before the native one, kernels/int4.py);
- the step and a verify over 4, 8 and 16 positions at a long context (2,048 cached tokens), with the
  native attention's query heads grouped by the kv head they share (as served) and one by one (the
  same bits), and llama.cpp's at that context;
- the host work per engine step outside the model's layers and output layer, from the engine's own
  timings, at batch 1 and 32 (plain decoding in this process);
- plain decoding's tokens/s at batch 8 and 32 on an in-process engine, against the same model on
  the torch paths (``SPECSTREAM_NATIVE=0``: how decoding ran before the native ops);
- a noisy host (tools.bench.noisy): plain decoding through a served stack, client-timed,
  quiet and with a low-priority CPU-bound process per core beside it (`nice -n 19` busy loops), in
  our session and in another session (with llama.cpp's plain decoding beside the latter), and the
  same for one step in this process;
- prefill as served, a 512-token prompt and the chat prompts (tools.bench.prefill);
- llama.cpp on the same GGUF file (when llama-cpp-python is installed: `make peer`): its 1-token
  step and its verify-shaped batches, quiet and noisy, and its prefill of the same prompts.

Prints tables, writes ``step.json`` and ``step.png`` (verify cost against positions, the bound
drawn in). What it does not know: speculation's gain (`bench latency`).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kernels import native
from kernels.int4 import Q4Weight, q4_rounded_native
from kernels.int8 import Q8Weight
from specstream.data.config import ModelSpec, TargetConfig
from specstream.data.engine import SequenceRequest, Speculation
from specstream.models import llama
from specstream.models.loader import load_model
from specstream.models.registry import resolve_model
from specstream.serving.compute import on_torch_thread
from tools.bench import report
from tools.bench.apart import run_apart
from tools.bench.compiled import compiled_curve_apart
from tools.bench.models import BenchModels
from tools.bench.noisy import noisy_neighbours, served_decoding
from tools.bench.prefill import LONG_PROMPT, llama_cpp_prefill_ms, long_prompt, ours_prefill_ms
from tools.progress import Progress
from target_service.engine import Engine
from target_service.inprocess import run_requests

CONTEXT = 200  # cached tokens before the timed step
POSITIONS = (1, 2, 4, 8, 16)  # a 1-token step, then verifies over γ + 1 positions
# A long context (an agent's transcript, a long conversation): the attention over the cache grows
# with it, per position verified.
LONG_CONTEXT = 2048
LONG_POSITIONS = (1, 4, 8, 16)
TARGETS = {2: 1.05, 4: 1.10, 8: 1.25, 16: 1.6}  # verify over n positions ÷ a 1-token step, at most
BOUND_TARGET = 1.3  # a 1-token step ÷ the bandwidth bound, at most
HOST_TARGETS_MS = {1: 0.5, 32: 2.0}  # host work per engine step, at most, by batch
NOISY_TARGET = 0.9  # noisy ÷ quiet decode speed, at least
PREFILL_CHAT_PROMPTS = 4  # the chat prompts prefilled beside the long one
# Beside busy loops in another session (an equal of ours to the scheduler): served decoding keeps at
# least this share of its quiet speed, and at least this many times llama.cpp's beside the same loops.
OTHER_SESSION_TARGET = 0.45
OTHER_SESSION_PEER_TARGET = 1.5
BATCHES = (8, 32)  # plain decoding throughput, new ÷ the torch paths
BATCH_TARGET = 1.3  # at least
ACCURACY_PROMPTS = 8  # prompts whose logits are compared with the file's exact values
# The forward with the layers' inputs as the served model does not take them (weights int4, int4-a8,
# int4-a16): by how many bits they are rounded to (0: not at all) -> (the data's key, the tables' label).
OTHER_ACTIVATIONS = {8: ("ours_int8_activations", "8-bit activations"),
                     16: ("ours_int16_activations", "16-bit activations"),
                     0: ("ours_exact_activations", "exact activations")}


# ----- what a step reads, and how fast this machine reads ---------------------------------------

def _tensor_bytes(value) -> int:
    if isinstance(value, Q4Weight):
        return sum(_tensor_bytes(t) for t in (value.packed, value.scale_zero, value.d, value.m) if t is not None)
    if isinstance(value, Q8Weight):
        return _tensor_bytes(value.codes) + _tensor_bytes(value.scale)
    return value.numel() * value.element_size()


def step_bytes(model, context: int) -> dict[str, int]:
    """Bytes a 1-token step reads: every layer's weights, the final norm and output layer (as the
    model holds them), and K and V of every layer over ``context`` positions. The input embedding
    contributes one row (a tied output layer reads it whole, as the output layer)."""
    layers = sum(_tensor_bytes(v) for layer in model.layers for v in vars(layer).values()
                 if isinstance(v, (torch.Tensor, Q4Weight)))
    layers += sum(_tensor_bytes(p) for layer in model.layers for p in layer.parameters())
    head = model.output_head
    output = _tensor_bytes(head.weight) + (_tensor_bytes(head.bias) if head.bias is not None else 0)
    config = model.config
    kv_element = torch.finfo(model.dtype).bits // 8
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * context * kv_element
    return {"layers": layers, "output layer": output, "kv cache": kv, "total": layers + output + kv}


def read_bandwidth_gbs(threads: int, size_bytes: int = 1 << 29, repeats: int = 7) -> float:
    """GB/s of a sum over ``size_bytes`` of float32 (16x the last-level cache of a small server),
    with ``threads`` threads: the median of ``repeats`` after a warm-up."""
    buffer = torch.ones(size_bytes // 4, dtype=torch.float32)  # [N]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer.sum()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return size_bytes / statistics.median(times) / 1e9


# ----- our forward ------------------------------------------------------------------------------

@torch.inference_mode()
def forward_curves(variants: dict[str, tuple], context: int = CONTEXT,
                   positions: tuple[int, ...] = POSITIONS, repeats: int = 20) -> dict[str, dict[int, float]]:
    """Median ms of a forward (layers and output layer over every position) over each number of
    new positions after ``context`` cached ones, batch 1, for each variant: name -> (model, whether
    its layers run fused[, whether the query heads of a kv head attend together]); a model keeps its
    native stacks for one setting (and its own ``activation_bits``), so give each setting a model
    of its own. Variants and
    positions take turns, round after round, so a slow spell of a shared machine falls on all of
    them alike."""
    runs = {}
    try:
        for name, (model, *setting) in variants.items():
            _set_variant(*setting)
            cache = model.new_cache(1, context + max(positions) + 1)
            model(torch.zeros(1, context, dtype=torch.int64), cache, torch.tensor([0]), torch.tensor([0]))
            runs[name] = (model, setting, cache)
        slot, start = torch.tensor([0]), torch.tensor([context])
        ids = {n: torch.full((1, n), 100, dtype=torch.int64) for n in positions}  # [1, n]
        times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in positions} for name in variants}
        for i in range(repeats + 3):
            for name, (model, setting, cache) in runs.items():
                _set_variant(*setting)
                for n in positions:
                    begin = time.perf_counter()
                    model(ids[n], cache, slot, start)
                    if i >= 3:
                        times[name][n].append((time.perf_counter() - begin) * 1000)
    finally:
        _set_variant(True)
    return {name: {n: statistics.median(t) for n, t in by_n.items()} for name, by_n in times.items()}


def _set_variant(fused: bool, grouped: bool = True) -> None:
    """``grouped``: the native attention runs the query heads of one kv head together (the same
    bits as one by one: kernels/csrc/attention.cpp)."""
    llama.FUSED_LAYERS = fused
    library = native.library()
    if library is not None:
        library.set_attention_groups(grouped)


def forward_curve(model, context: int = CONTEXT, positions: tuple[int, ...] = POSITIONS,
                  repeats: int = 20) -> dict[int, float]:
    """``forward_curves`` of one model as it serves."""
    return forward_curves({"model": (model, True)}, context, positions, repeats)["model"]


def quiet_and_noisy_step(model, repeats: int = 20) -> dict[str, float]:
    """Median ms of a 1-token step quiet, beside the busy loops (``noisy_neighbours``), quiet again."""
    out = {}
    for label in ("quiet", "noisy", "quiet again"):
        if label == "noisy":
            with noisy_neighbours():
                out[label] = forward_curve(model, positions=(1,), repeats=repeats)[1]
        else:
            out[label] = forward_curve(model, positions=(1,), repeats=repeats)[1]
    return out


def with_aten_int4(model) -> int:
    """Moves every 4-bit matrix the native kernel serves to ATen's int4 kernel (the old matmul), in
    place; returns how many moved."""
    moved = 0
    for layer in model.layers:
        for attr, value in list(vars(layer).items()):
            if isinstance(value, Q4Weight) and value.native:
                setattr(layer, attr, Q4Weight.from_parts(*value.parts(), model.dtype, use_native=False))
                moved += 1
    return moved


def host_ms_per_step(model, batch: int, steps: int = 40, prompt: int = 32,
                     warm_up: bool = True) -> dict[str, float]:
    """Plain decoding of ``batch`` sequences for ``steps`` steps on an in-process engine; from the
    engine's own timings (EngineTimings): ms per decode step, of it in the layers' forward, in the
    whole compute call (layers, output layer, verification), and the rest: host work. ``warm_up``:
    an engine of its own decodes first, untimed (a first engine's steps took 1.1-1.3 ms of host
    work where the next ones' took 0.56-0.58, AVX2 EPYC)."""
    config = TargetConfig(model=ModelSpec("bench"), max_slots=batch, max_seq_len=prompt + steps + 8, max_gamma=4,
                          calibrate=False)
    requests = [SequenceRequest(str(i), [1 + (i + j) % 50 for j in range(prompt)], steps,
                                speculation=Speculation("off")) for i in range(batch)]
    if warm_up:
        run_requests(Engine(model, config, None), requests, timeout_s=600)
    engine = Engine(model, config, None)
    run_requests(engine, requests, timeout_s=600)
    t = engine.timings
    per_step = {"step_ms": t.decode_s, "forward_ms": t.decode_forward_s, "compute_ms": t.decode_compute_s}
    out = {name: 1000 * seconds / t.decode_steps for name, seconds in per_step.items()}
    return {"steps": t.decode_steps, **out, "host_ms": out["step_ms"] - out["compute_ms"]}


@contextmanager
def torch_paths() -> Iterator[None]:
    """The block runs with the native library off (``SPECSTREAM_NATIVE=0``): the torch paths,
    ATen's int4 kernel and the dequantized output layer, as decoding ran before the native ops. A
    model loaded inside keeps that layout."""
    previous = os.environ.get("SPECSTREAM_NATIVE")
    os.environ["SPECSTREAM_NATIVE"] = "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("SPECSTREAM_NATIVE")
        else:
            os.environ["SPECSTREAM_NATIVE"] = previous


def batch_throughput(new, old, batches: tuple[int, ...] = BATCHES, rounds: int = 2) -> dict[int, dict[str, float]]:
    """Tokens/s of plain decoding on an in-process engine at each batch size (the engine's decode
    steps only), the model as it serves (``new``) and ``old`` under ``torch_paths``, taking turns."""
    out: dict[int, dict[str, list[float]]] = {b: {"new": [], "old": []} for b in batches}
    for _ in range(rounds):
        for b in batches:
            out[b]["new"].append(_tokens_per_s(new, b))
            with torch_paths():
                out[b]["old"].append(_tokens_per_s(old, b))
    return {b: {k: statistics.median(v) for k, v in runs.items()} for b, runs in out.items()}


def _tokens_per_s(model, batch: int) -> float:
    timings = host_ms_per_step(model, batch, steps=24, warm_up=False)
    return batch * 1000 / timings["step_ms"]


# ----- what the fast paths cost in accuracy -----------------------------------------------------

@torch.inference_mode()
def logits_error(exact, variants: dict[str, tuple], prompts: list[list[int]]) -> dict[str, dict[str, float]]:
    """Each variant's logits (name -> (model, fused) as ``forward_curves`` takes them) against
    ``exact``'s (the file's values in float32) over every position of ``prompts``: the mean and
    largest |difference| and how often the top token is the same."""
    want = [_prompt_logits(exact, ids) for ids in prompts]
    out = {}
    try:
        for name, (model, *setting) in variants.items():
            _set_variant(*setting)
            out[name] = _error_summary([_prompt_logits(model, ids) for ids in prompts], want)
    finally:
        _set_variant(True)
    return out


def _prompt_logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(ids))
    return model(torch.tensor([ids]), cache, torch.tensor([cache.alloc()]), torch.tensor([0]))[0].float()  # [T, V]


def _error_summary(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, float]:
    diffs = torch.cat([(g - w).abs().flatten() for g, w in zip(got, want)])
    same = torch.cat([g.argmax(-1) == w.argmax(-1) for g, w in zip(got, want)]).float()
    return {"mean_abs": diffs.mean().item(), "max_abs": diffs.max().item(), "top1_agree": same.mean().item()}


@torch.inference_mode()
def _peer_error(exact, prompts: list[list[int]], peer: list[list[list[float]]]) -> dict[str, float]:
    return _error_summary([torch.tensor(p) for p in peer], [_prompt_logits(exact, ids) for ids in prompts])


def llama_cpp_logits_apart(gguf: Path, prompts: list[list[int]]) -> list[list[list[float]]] | None:
    """llama.cpp's logits at every position of each prompt (one ``llama_decode`` per prompt), in a
    process of its own; None without llama-cpp-python."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    return run_apart(llama_cpp_logits, gguf=str(gguf), prompts=prompts)


def llama_cpp_logits(gguf: Path, prompts: list[list[int]]) -> list[list[list[float]]]:
    llm = _llama(gguf, max(len(p) for p in prompts) + 8)
    out = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        out.append([list(map(float, row)) for row in llm.scores[:len(ids)]])
    return out


def llama_cpp_invariance_apart(gguf: Path, positions: tuple[int, ...] = POSITIONS[1:]) -> dict[int, dict] | None:
    """``llama_cpp_invariance`` in a process of its own; None without llama-cpp-python."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    out = run_apart(llama_cpp_invariance, gguf=str(gguf), positions=list(positions))
    return {int(n): v for n, v in out.items()}


def llama_cpp_invariance(gguf: Path, positions: tuple[int, ...], context: int = CONTEXT) -> dict[int, dict]:
    """Whether ggml computes a position's logits the same alone as in a verify-shaped batch: after
    ``context`` cached tokens, the same new tokens decoded one per ``llama_decode`` and n at once;
    per n, the largest |difference| and how many of the n rows differ at all (ours: none, by
    construction and by test, tests/test_native_ops.py)."""
    import numpy as np
    llm = _llama(gguf, context + max(positions) + 8)
    prefix = [1 + i % 50 for i in range(context)]
    new = [100 + 7 * i for i in range(max(positions))]
    llm.reset()
    llm.eval(prefix)
    for token in new:
        llm.eval([token])
    alone = np.array(llm.scores[context:context + len(new)])  # [n, V]
    out = {}
    for n in positions:
        llm.reset()
        llm.eval(prefix)
        llm.eval(new[:n])
        diff = np.abs(np.array(llm.scores[context:context + n]) - alone[:n])  # [n, V]
        out[n] = {"max_abs": float(diff.max()), "rows_differing": int((diff.max(axis=1) > 0).sum())}
    return out


# ----- llama.cpp --------------------------------------------------------------------------------

def _llama(gguf, n_ctx: int):
    """llama.cpp on ``gguf`` with every position's logits kept, one thread per core."""
    from llama_cpp import Llama  # optional: installed by `make peer`

    return Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=os.cpu_count(), n_batch=512, logits_all=True,
                 verbose=False)


def llama_cpp_curve_apart(gguf: Path, positions: tuple[int, ...] = POSITIONS, repeats: int = 20,
                          context: int = CONTEXT) -> dict[int, float] | None:
    """``llama_cpp_curve`` in a process of its own, as a user runs llama.cpp: inside this one it
    measured up to twice as slow (its thread pool beside torch's OpenMP team); None without
    llama-cpp-python."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    out = run_apart(llama_cpp_curve, gguf=str(gguf), context=context, positions=list(positions), repeats=repeats)
    return {int(n): ms for n, ms in out.items()}


def llama_cpp_curve(gguf: Path, context: int = CONTEXT, positions: tuple[int, ...] = POSITIONS,
                    repeats: int = 20) -> dict[int, float] | None:
    """Median ms of llama.cpp's forward (``llama_decode``) over each number of new positions after
    ``context`` cached ones, every position's logits computed; None without llama-cpp-python."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    llm = _llama(gguf, context + 2 * max(positions) + 8)
    llm.eval([1 + i % 50 for i in range(context)])  # the cached prefix, once
    out = {}
    for n in positions:
        times = []
        for i in range(repeats + 3):
            llm.n_tokens = context  # back to the prefix: eval drops the cache's entries past it first
            begin = time.perf_counter()
            llm.eval([100] * n)
            if i >= 3:
                times.append((time.perf_counter() - begin) * 1000)
        out[n] = statistics.median(times)
    return out


# ----- the run ----------------------------------------------------------------------------------

def _ratios(curve: dict[int, float]) -> dict[int, float]:
    return {n: ms / curve[1] for n, ms in curve.items()}


def _measure(models: BenchModels, progress: Progress) -> dict:
    """Our figures. Torch work runs on the process's torch thread (specstream.serving.compute);
    the engine runs there by itself."""
    model = models.load("target")
    threads = on_torch_thread(torch.get_num_threads)
    data = {"model": models.label, "weights": model.weights, "dtype": models.dtype, "context": CONTEXT,
            "threads": threads, "bytes": step_bytes(model, CONTEXT)}
    progress.phase("step: bandwidth")
    data["bandwidth_gbs"] = {1: on_torch_thread(read_bandwidth_gbs, 1),
                             threads: on_torch_thread(read_bandwidth_gbs, threads)}
    data["bound_ms"] = data["bytes"]["total"] / data["bandwidth_gbs"][threads] / 1e6
    progress.update()
    progress.phase("step: our forward, fused, op by op, with the other activations, on ATen's int4 kernel and dense")
    variants = {"ours": (model, True)}
    if _fused(model):  # a model of its own: one that took turns fused and op by op rebuilt its stacks each turn
        variants["ours_op_by_op"] = (models.load("target"), False)
    for bits, (name, _) in OTHER_ACTIVATIONS.items():  # the layers' inputs as ours does not serve them
        if bits != model.activation_bits and _fused(model) and (not bits or q4_rounded_native(model.dtype, bits)):
            other = models.load("target")
            other.activation_bits = bits
            variants[name] = (other, True)
    old = models.load("target")
    # how a bfloat16 step ran before our kernel; in float32 ATen's kernel never served (dense did)
    if model.dtype == torch.bfloat16 and on_torch_thread(with_aten_int4, old):
        variants["ours_aten_int4"] = (old, False)
    dense = on_torch_thread(load_model, models.target, dtype=models.dtype, resolve=resolve_model, weights="dense")
    if not model.weights.startswith("dense"):
        variants["dense"] = (dense, True)
    data.update(on_torch_thread(forward_curves, variants))
    del old
    progress.update()
    # a model with a shorter window (the tests' tiny ones) is measured as far as it reaches
    data["long_context"] = min(LONG_CONTEXT, model.config.max_position_embeddings - max(LONG_POSITIONS) - 1)
    progress.phase(f"step: a verify at context {data['long_context']}, the query heads of a kv head together "
                   "and one by one")
    long_variants = {"ours": (model, True), "heads_one_by_one": (model, True, False)}
    data["long"] = on_torch_thread(forward_curves, long_variants, data["long_context"], LONG_POSITIONS, 10)
    progress.update()
    progress.phase("step: logits against the file's exact values")
    exact = on_torch_thread(load_model, models.target, dtype="float32", resolve=resolve_model, weights="dense")
    prompts = models.prompts(ACCURACY_PROMPTS)
    checked = {"dense": (dense, True), "ours": (model, True),
               **{name: variants[name] for name, _ in OTHER_ACTIVATIONS.values() if name in variants}}
    data["accuracy"] = on_torch_thread(logits_error, exact, checked, prompts)
    if models.gguf is not None:
        peer = llama_cpp_logits_apart(models.gguf, prompts)
        if peer is not None:  # on the torch thread: a second thread's torch ops would slow it afterwards
            data["accuracy"]["llama_cpp"] = on_torch_thread(_peer_error, exact, prompts, peer)
    del exact, dense, variants
    progress.update()
    progress.phase("step: host work per engine step")
    data["host"] = {b: host_ms_per_step(model, b) for b in HOST_TARGETS_MS}
    progress.update()
    progress.phase("step: throughput at batch 8 and 32, against the torch paths")
    with torch_paths():
        old = models.load("target")
    data["batch_throughput"] = batch_throughput(model, old)
    del old
    progress.update()
    progress.phase("step: beside nice-19 busy loops")
    data["step_noisy"] = on_torch_thread(quiet_and_noisy_step, model)
    progress.update()
    progress.phase("step: served decoding, quiet and noisy")
    data["served"] = served_decoding(models)
    progress.update()
    progress.phase("step: prefill")
    # (a model with a shorter window, the tests' tiny ones: as long as it reaches)
    length = min(LONG_PROMPT, model.config.max_position_embeddings - 1)
    prompts = [long_prompt(models.tokenizer(), length), *models.prompts(PREFILL_CHAT_PROMPTS)]
    data["prefill"] = {"tokens": [len(p) for p in prompts], "ours_ms": on_torch_thread(ours_prefill_ms, model, prompts)}
    data["prefill_prompts"] = prompts  # for llama.cpp's, in _measure_peer
    progress.update()
    return data


def _fused(model) -> bool:
    """Whether some of ``model``'s layers run as one native call (4-bit projections on the native kernel)."""
    return any(stack is not None for _, stack in model.native_runs(model.dtype))


def _measure_peer(models: BenchModels, data: dict, progress: Progress) -> None:
    progress.phase("step: llama.cpp")
    if models.gguf is None:
        data["llama_cpp"] = None
        data["llama_cpp_note"] = "the target has no GGUF file"
    else:
        data["llama_cpp"] = llama_cpp_curve_apart(models.gguf)
        if data["llama_cpp"] is not None:
            data["llama_cpp_long"] = llama_cpp_curve_apart(models.gguf, LONG_POSITIONS, 10, data["long_context"])
            data["llama_cpp_invariance"] = llama_cpp_invariance_apart(models.gguf)
            with noisy_neighbours():
                data["llama_cpp_noisy"] = llama_cpp_curve_apart(models.gguf, positions=(1,), repeats=10)
            data["prefill"]["llama_cpp_ms"] = run_apart(llama_cpp_prefill_ms, gguf=str(models.gguf),
                                                        prompts=data["prefill_prompts"])
        else:
            data["llama_cpp_note"] = "llama-cpp-python is not installed (make peer)"
    progress.update()


def run(models: BenchModels, out_dir: Path, quiet: bool = False, compiled: bool = False) -> dict:
    with Progress(12 if compiled else 11, "measurements", "step", quiet=quiet) as progress:
        data = _measure(models, progress)
        if compiled:
            progress.phase("step: the forward compiled over a static cache (torch.compile, a shape per bucket)")
            # our kernels as extern calls, and ATen's int4 kernel (the weight-only quantised matmul
            # inductor calls on a CPU without AMX)
            data["compiled"] = {matmul: compiled_curve_apart(models.target, models.dtype, models.weights, CONTEXT,
                                                             POSITIONS, matmul) for matmul in ("native", "int4")}
            progress.update()
        _measure_peer(models, data, progress)
    data.pop("prefill_prompts")
    _summarize(data)
    print(tables(data), flush=True)
    report.write_json(out_dir / "step.json", data)
    _plot(data, out_dir / "step.png")
    print(f"wrote {out_dir / 'step.json'}, {out_dir / 'step.png'}", flush=True)
    return data


def _summarize(data: dict) -> None:
    """The goal lines: each figure, its target and whether it is met."""
    ours = data["ours"]
    data["verify_over_step"] = _ratios(ours)
    data["step_over_bound"] = ours[1] / data["bound_ms"]
    noisy = data["step_noisy"]
    data["step_noisy_over_quiet"] = (noisy["quiet"] + noisy["quiet again"]) / 2 / noisy["noisy"]  # as speeds
    peer = data.get("llama_cpp")
    if peer:
        data["llama_cpp_verify_over_step"] = _ratios(peer)
        data["ours_over_llama_cpp"] = peer[1] / ours[1]  # speed ratio
        data["llama_cpp_noisy_over_quiet"] = peer[1] / data["llama_cpp_noisy"][1]
    goals = [("1-token step ÷ bound", data["step_over_bound"], f"≤ {BOUND_TARGET}",
              data["step_over_bound"] <= BOUND_TARGET)]
    goals += [(f"verify over {n} ÷ step", data["verify_over_step"][n], f"≤ {t}", data["verify_over_step"][n] <= t)
              for n, t in TARGETS.items()]
    goals += [(f"host ms per step, batch {b}", data["host"][b]["host_ms"], f"≤ {t}", data["host"][b]["host_ms"] <= t)
              for b, t in HOST_TARGETS_MS.items()]
    for b, tps in data["batch_throughput"].items():
        tps["ratio"] = tps["new"] / tps["old"]
        goals.append((f"batch {b} tokens/s ÷ the torch paths'", tps["ratio"], f"≥ {BATCH_TARGET}",
                      tps["ratio"] >= BATCH_TARGET))
    served = data["served"]["noisy_over_quiet"]
    goals.append(("served decoding, noisy ÷ quiet", served, f"≥ {NOISY_TARGET}", served >= NOISY_TARGET))
    goals.append(("one step, noisy ÷ quiet", data["step_noisy_over_quiet"], f"≥ {NOISY_TARGET}",
                  data["step_noisy_over_quiet"] >= NOISY_TARGET))
    other = data["served"]["other_session_over_quiet"]
    goals.append(("served decoding, loops in another session ÷ quiet", other, f"≥ {OTHER_SESSION_TARGET}",
                  other >= OTHER_SESSION_TARGET))
    if "other_session_over_llama_cpp" in data["served"]:
        versus = data["served"]["other_session_over_llama_cpp"]
        goals.append(("served decoding ÷ llama.cpp's, both beside loops in another session", versus,
                      f"≥ {OTHER_SESSION_PEER_TARGET}", versus >= OTHER_SESSION_PEER_TARGET))
    if peer:
        goals.append(("our step ÷ llama.cpp's, speed", data["ours_over_llama_cpp"], "≥ 1.0",
                      data["ours_over_llama_cpp"] >= 1.0))
    prefill = data["prefill"]
    prefill["ours_tokens_per_s"] = [n / ms * 1e3 for n, ms in zip(prefill["tokens"], prefill["ours_ms"])]
    if "llama_cpp_ms" in prefill:
        peer_ms = prefill["llama_cpp_ms"]
        prefill["llama_cpp_tokens_per_s"] = [n / ms * 1e3 for n, ms in zip(prefill["tokens"], peer_ms)]
        # speed ratios: the long prompt alone, and the chat prompts together (their tokens over their time)
        prefill["long_over_llama_cpp"] = peer_ms[0] / prefill["ours_ms"][0]
        prefill["chat_over_llama_cpp"] = sum(peer_ms[1:]) / sum(prefill["ours_ms"][1:])
        goals += [(f"prefill ÷ llama.cpp's, a {prefill['tokens'][0]}-token prompt", prefill["long_over_llama_cpp"],
                   "≥ 1.0", prefill["long_over_llama_cpp"] >= 1.0),
                  ("prefill ÷ llama.cpp's, the chat prompts", prefill["chat_over_llama_cpp"], "≥ 1.0",
                   prefill["chat_over_llama_cpp"] >= 1.0)]
    data["goals"] = [{"goal": g, "value": v, "target": t, "met": m} for g, v, t, m in goals]


def tables(data: dict, markdown: bool = False) -> str:
    fmt = report.markdown_table if markdown else report.table
    head = (f"{data['model']} ({data['weights']} weights, {data['dtype']}), context {data['context']}, "
            f"{data['threads']} threads: a step reads {data['bytes']['total'] / 1e6:.1f} MB "
            f"(layers {data['bytes']['layers'] / 1e6:.1f}, output layer {data['bytes']['output layer'] / 1e6:.1f}, "
            f"KV {data['bytes']['kv cache'] / 1e6:.1f}); read bandwidth {data['bandwidth_gbs'][data['threads']]:.1f} "
            f"GB/s ({data['bandwidth_gbs'][1]:.1f} on one thread): bound {data['bound_ms']:.2f} ms")
    peer = data.get("llama_cpp") or {}
    old = data.get("ours_aten_int4") or {}
    others = {label: data[name] for name, label in OTHER_ACTIVATIONS.values() if data.get(name)}
    ops = data.get("ours_op_by_op") or {}
    dense = data.get("dense") or {}
    rows = [[n, data["ours"][n], data["verify_over_step"][n], TARGETS.get(n, "-"), *([ops[n]] if ops else []),
             *(v for other in others.values() for v in (other[n], other[n] / other[1])),
             *([old[n], old[n] / old[1]] if old else []),
             *([dense[n], dense[n] / data["ours"][n]] if dense else []),
             *([peer[n], data["llama_cpp_verify_over_step"][n]] if peer else [])] for n in data["ours"]]
    headers = ["positions", "ours ms", "÷ step", "target", *(["op by op ms"] if ops else []),
               *(h for label in others for h in (f"{label} ms", "÷ step")),
               *(["ATen int4 ms", "÷ step"] if old else []),
               *([f"dense {data['dtype']} ms", "÷ ours"] if dense else []),
               *(["llama.cpp ms", "÷ step"] if peer else [])]
    names = {"dense": f"dense {data['dtype']}", "ours": "ours, as served", "llama_cpp": "llama.cpp",
             **{name: f"ours, {label}" for name, label in OTHER_ACTIVATIONS.values()}}
    accuracy = [[names.get(k, k), a["mean_abs"], a["max_abs"], a["top1_agree"]]
                for k, a in data.get("accuracy", {}).items()]
    goals = [[g["goal"], g["value"], g["target"], "met" if g["met"] else "MISSED"] for g in data["goals"]]
    served = data["served"]
    noisy = (f"served plain decoding, client-timed: {served['quiet']:.1f} tok/s quiet, {served['noisy']:.1f} beside "
             f"nice-19 busy loops in our session, {served['other_session']:.1f} beside them in another session "
             f"(means of {len(served['quiet_runs'])}, {len(served['noisy_runs'])} and "
             f"{len(served['other_session_runs'])} spells in turn)")
    fixed = served["fixed_threads"]
    noisy += (f"; the target's thread count fixed (--fixed-threads): {fixed['quiet']:.1f} quiet, "
              f"{fixed['other_session']:.1f} beside the loops in another session (adaptive ÷ fixed there: "
              f"{served['other_session_over_fixed_threads']:.2f})")
    if "llama_cpp" in served:
        noisy += (f"; llama.cpp plain decoding, the same prompts: {served['llama_cpp']:.1f} tok/s quiet, "
                  f"{served['llama_cpp_other_session']:.1f} beside the loops in another session")
    if peer:
        noisy += f"; llama.cpp's step noisy ÷ quiet: {data['llama_cpp_noisy_over_quiet']:.2f}"
    noisy += "\nplain decoding, in-process engine, tokens/s: " + ", ".join(
        f"batch {b} {t['new']:.1f} (torch paths {t['old']:.1f}, {t['ratio']:.2f}x)" for b, t in data["batch_throughput"].items())
    prefill = data["prefill"]
    peer_prefill = prefill.get("llama_cpp_ms")
    prefill_table = "prefill, as served (ms; tokens/s), against llama.cpp's eval of the same ids:\n" + fmt(
        ["prompt", "tokens", "ours ms", "ours tok/s", *(["llama.cpp ms", "llama.cpp tok/s", "ours ÷ llama.cpp"]
                                                       if peer_prefill else [])],
        [["long" if i == 0 else f"chat {i}", n, ms, prefill["ours_tokens_per_s"][i],
          *([peer_prefill[i], prefill["llama_cpp_tokens_per_s"][i], peer_prefill[i] / ms] if peer_prefill else [])]
         for i, (n, ms) in enumerate(zip(prefill["tokens"], prefill["ours_ms"]))])
    parts = [head, fmt(headers, rows), noisy, prefill_table]
    for matmul, c in (data.get("compiled") or {}).items():
        what = "our kernels" if matmul == "native" else "ATen's int4 kernel" if matmul == "int4" else matmul
        parts.append(f"the forward compiled over a static cache (torch.compile; matrices: {what}), against the same "
                     "forward eager, and its logits against ours:\n" + fmt(
                         ["positions", "compile s", "compiled ms", "÷ ours", "eager ms", "max |Δ| logits",
                          "same greedy tokens"],
                         [[n, c["compile_s"][n], c["compiled"][n], c["compiled"][n] / data["ours"][n], c["eager"][n],
                           c["agreement"][n]["max_abs"], c["agreement"][n]["same_greedy"]] for n in c["compiled"]]))
    if data.get("llama_cpp_invariance"):
        parts.append("llama.cpp, a position's logits in a batch of n against the same position decoded alone: " +
                     "; ".join(f"n={n}: {v['rows_differing']} of {n} rows differ, by up to {v['max_abs']:.3g}"
                               for n, v in data["llama_cpp_invariance"].items()))
    if data.get("long"):
        long, peer_long = data["long"], data.get("llama_cpp_long") or {}
        parts.append(f"a verify at context {data['long_context']} (ms; ÷ step: against the 1-token step at that "
                     "context; one by one: the native attention without its query heads grouped by kv head, "
                     "the same bits):\n" + fmt(
                         ["positions", "ours ms", "÷ step", "heads one by one ms", "÷ ours",
                          *(["llama.cpp ms", "÷ step", "÷ ours"] if peer_long else [])],
                         [[n, long["ours"][n], long["ours"][n] / long["ours"][1], long["heads_one_by_one"][n],
                           long["heads_one_by_one"][n] / long["ours"][n],
                           *([peer_long[n], peer_long[n] / peer_long[1], peer_long[n] / long["ours"][n]]
                             if peer_long else [])] for n in long["ours"]]))
    if accuracy:
        parts.append("logits against the file's values in float32, every position of "
                     f"{ACCURACY_PROMPTS} prompts:\n" + fmt(["path", "mean |Δ|", "max |Δ|", "same top token"], accuracy))
    return "\n\n".join([*parts, fmt(["goal", "measured", "target", ""], goals)])


def _plot(data: dict, path: Path) -> None:
    plt = report.pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series: dict[str, Callable[[], dict]] = {"ours": lambda: data["ours"]}
    if data.get("ours_op_by_op"):
        series["ours, layers op by op"] = lambda: data["ours_op_by_op"]
    if data.get("dense"):
        series[f"dense {data['dtype']}"] = lambda: data["dense"]
    for matmul, c in (data.get("compiled") or {}).items():
        series[f"torch.compile, static cache ({matmul})"] = lambda c=c: {int(n): ms for n, ms in c["compiled"].items()}
    for name, label in OTHER_ACTIVATIONS.values():
        if data.get(name):
            series[f"ours, {label}"] = lambda name=name: data[name]
    if data.get("ours_aten_int4"):
        series["ours, ATen's int4 matmul, op by op"] = lambda: data["ours_aten_int4"]
    if data.get("llama_cpp"):
        series["llama.cpp"] = lambda: data["llama_cpp"]
    for label, get in series.items():
        curve = get()
        ax.plot(list(curve), list(curve.values()), marker="o", label=label)
    ax.axhline(data["bound_ms"], color="grey", linestyle="--", label="bandwidth bound (1 token)")
    ax.set(title=f"Forward ms by positions ({data['model']}, {data['threads']} threads)", xlabel="positions",
           ylabel="ms", xscale="log", xticks=list(POSITIONS), xticklabels=[str(p) for p in POSITIONS])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    report.save_figure(fig, path)
    plt.close(fig)
