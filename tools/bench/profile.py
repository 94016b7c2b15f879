"""`specstream bench profile`: where one decode step's time goes, on this machine.

For the served target (batch 1, a 200-token context) it times, each as the median of repeated
runs: the embedding lookup, the 30 attention blocks and the 30 MLP blocks op by op, the 30 layers
as the model serves them (one native call for all where they fuse: models/llama.py), the output
layer over the whole vocabulary, and the whole forward; what the forward costs beyond the
embedding, the layers as served and the output layer is Python and dispatch between them. It does so for a
1-token step and for a 5-token verify (γ = 4). Then one draft step (a feature draft's: one propose
call with one guess, as it serves), and a propose round trip to a real draft service over gRPC on
loopback (γ = 4, one sequence; a feature draft gets one feature a call), whose excess over the
draft's own compute is the RPC and its serialisation. Prints a table, writes ``profile.json`` and a PNG.

What it does not know: the engine (``bench latency`` and ``experiment`` measure whole requests).
"""

from __future__ import annotations

import queue
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specstream.serving.compute import on_torch_thread
from tools.bench import report
from tools.bench.costs import measure_feature_costs
from tools.bench.models import BenchModels
from tools.progress import Progress

CONTEXT = 200
# what `components` times: embedding, attention, MLP, the layers as served, output layer, the whole forward
COMPONENT_TIMINGS = 6
LAYERS_AS_SERVED = "layers as served"  # the row's name starts so: one native call where they fuse


def _median_ms(fn, repeats: int = 40, progress: Progress | None = None) -> float:
    """The median of ``repeats`` timed calls after 5 untimed ones; ``progress`` counts it as one timing."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    if progress is not None:
        progress.update()
    return statistics.median(times) * 1000


def planned_timings(models: BenchModels) -> int:
    """The timings `run` takes (its progress total): a 1-token step's and a 5-token verify's
    components, and with a draft its step's, its proposals in process and over gRPC."""
    return 2 * COMPONENT_TIMINGS + (COMPONENT_TIMINGS + 2 if models.draft is not None else 0)


@torch.inference_mode()
def components(model, tokens: int, progress: Progress | None = None) -> dict[str, float]:
    """ms per part of one forward over `tokens` new positions after CONTEXT cached ones
    (COMPONENT_TIMINGS timings, each counted by ``progress``)."""
    cache = model.new_cache(1, CONTEXT + tokens + 1)
    slot, start = torch.tensor([cache.alloc()]), torch.tensor([CONTEXT])
    model(torch.zeros(1, CONTEXT, dtype=torch.int64), cache, slot, torch.tensor([0]))  # fill the context
    ids = torch.full((1, tokens), 100, dtype=torch.int64)  # [1, T]
    batch = model._cache_batch(ids, cache, slot, start)
    x, cos, sin = model.embed_positions(ids, batch)
    rope = (model.rope_cos, model.rope_sin) if batch.native_ready(model.dtype) else None  # as `hidden` runs them
    layers = list(model.layers)
    parts = {
        "embedding + RoPE rows": lambda: model.embed_positions(ids, model._cache_batch(ids, cache, slot, start)),
        f"attention x{len(layers)}": lambda: [layer.attention(x, batch, cos, sin, rope) for layer in layers],
        f"MLP x{len(layers)}": lambda: [layer.mlp(x) for layer in layers],
        f"{LAYERS_AS_SERVED} x{len(layers)} ({_layer_kind(model, x.dtype, rope)})":
            lambda: _layers_as_served(model, layers, x, batch, cos, sin, rope),
        f"output layer ({model.config.output_vocab or model.config.vocab_size} rows)":
            lambda: model.output_head.logits(x),
    }
    out = {name: _median_ms(part, progress=progress) for name, part in parts.items()}
    whole = _median_ms(lambda: model(ids, cache, slot, start), progress=progress)
    served = sum(v for k, v in out.items() if not k.startswith(("attention", "MLP")))  # embedding, layers, output
    out["Python and dispatch between them"] = max(whole - served, 0.0)
    out["whole forward"] = whole
    return out


def _layer_kind(model, dtype: torch.dtype, rope) -> str:
    runs = model.native_runs(dtype) if rope is not None and hasattr(model, "native_runs") else []
    native = sum(len(layers) for layers, stack in runs if stack is not None)
    return "op by op" if not native else f"{native} in {sum(s is not None for _, s in runs)} native call(s)"


def _layers_as_served(model, layers, x, batch, cos, sin, rope):
    if hasattr(model, "run_layers"):
        return model.run_layers(x, batch, cos, sin, rope)
    return [layer(x, batch, cos, sin, rope) for layer in layers]


def local_propose_ms(models: BenchModels, gamma: int = 4, rounds: int = 40,
                     progress: Progress | None = None) -> tuple[float, int]:
    """ms of γ proposals for one sequence computed in this process (call on the torch thread),
    each call appending one token (with a feature draft, its feature: zeros, as the compute does not
    depend on the values), and the width of the features the draft reads (0: a token draft); one
    timing for ``progress``."""
    from draft_service.feature import FeatureProposer
    from draft_service.proposer import DraftProposer
    from specstream.data.propose import ProposeItem

    prompt = models.prompts(1)[0]
    local = (FeatureProposer if models.feature_draft else DraftProposer)(models.load("draft"), 4, 1024)
    width = getattr(local, "feature_width", 0)

    def local_round(i: int) -> None:
        appended = prompt if i == 0 else [100]
        local.propose([ProposeItem("s", 0 if i == 0 else len(prompt) + i - 1, appended, gamma,
                                   **_zero_features(width, len(appended) - (i == 0)))])

    local_round(0)
    return _median_ms(lambda: local_round(1), rounds, progress), width


def _zero_features(width: int, count: int) -> dict:
    """A ProposeItem's feature fields for ``count`` features of ``width`` zeros (bfloat16); none for width 0."""
    return {"features": bytes(2 * width * count), "feature_width": width} if width else {}


def rpc_round_trip(models: BenchModels, in_process: float, gamma: int = 4, rounds: int = 40,
                   progress: Progress | None = None, feature_width: int = 0) -> dict[str, float]:
    """ms of a propose round trip to a real draft process (one sequence, γ proposals; a feature
    draft's with ``feature_width`` features), beside ``in_process``, the ms of the same proposals
    computed in this process; one timing for ``progress``."""
    from tools.launcher import Stack, StackSpec
    from specstream_pb import draft_pb2, draft_pb2_grpc

    prompt = models.prompts(1)[0]
    with tempfile.TemporaryDirectory() as logs, \
            Stack(StackSpec(str(models.target), str(models.require_draft()), dtype=models.dtype,
                            weights=models.weights, log_dir=logs)) as stack:
        with stack.channel("draft") as channel:
            stub = draft_pb2_grpc.DraftStub(channel)
            q: queue.Queue = queue.Queue()
            responses = stub.Speculate(iter(q.get, None))

            def round_trip(first: bool) -> None:
                appended = prompt if first else [100]
                features = _zero_features(feature_width, len(appended) - first)
                item = draft_pb2.ProposeItem(seq_id=1, rollback_to=0 if first else len(prompt),
                                             append_token_ids=appended, gamma=gamma,
                                             features=features.get("features", b""),
                                             feature_dtype="bfloat16" if features else "",
                                             feature_width=feature_width)
                q.put(draft_pb2.ProposeRequest(propose=draft_pb2.ProposeBatch(step=1, items=[item])))
                (proposal,) = next(responses).proposals
                if proposal.error or len(proposal.token_ids) != gamma:  # a refusal would time nothing
                    raise RuntimeError(f"the draft did not propose {gamma} tokens: {proposal}")

            round_trip(True)
            remote = _median_ms(lambda: round_trip(False), rounds, progress)
            q.put(None)
    return {"draft compute, in process": in_process, "gRPC round trip": remote,
            "RPC + serialisation": max(remote - in_process, 0.0)}


def _time_models(models: BenchModels, progress: Progress) -> dict:
    """The in-process timings (run on the torch thread: specstream.serving.compute)."""
    target = models.load("target")
    result: dict = {"models": models.label, "dtype": models.dtype, "threads": torch.get_num_threads(),
                    "context": CONTEXT, "weights": target.weights}
    progress.print(f"{models.label} ({models.dtype}, {target.weights} weights, {torch.get_num_threads()} threads): "
                   "timing a 1-token step ...")
    progress.phase("profile: target, 1-token step")
    result["target_step"] = components(target, 1, progress)
    progress.print("... a 5-token verify ...")
    progress.phase("profile: target, 5-token verify")
    result["target_verify5"] = components(target, 5, progress)
    if models.draft is not None:
        progress.phase("profile: draft step and proposals")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the draft service runs it
        draft = models.load("draft")
        result["draft_weights"] = draft.weights
        if models.feature_draft:  # no forward of its own: its guess is timed as it serves (bench/costs.py)
            guess = measure_feature_costs(models.target, models.draft, models.dtype, CONTEXT, 1)
            result["draft_step"] = {"whole forward": guess["draft_call_ms"]["1"]}
            for _ in range(COMPONENT_TIMINGS):
                progress.update()
        else:
            result["draft_step"] = components(draft, 1, progress)
        result["draft_propose_ms"], result["draft_feature_width"] = local_propose_ms(models, progress=progress)
        torch.set_num_threads(threads)
    return result


def run(models: BenchModels, out_dir: Path, quiet: bool = False) -> dict:
    """The table on stdout, ``profile.json`` and a plot in ``out_dir``. Progress on stderr
    (tools.progress; ``quiet``: plain lines, never a bar), counted in timings."""
    with Progress(planned_timings(models), "timings", "profile", quiet=quiet) as progress:
        result = on_torch_thread(_time_models, models, progress)
        rows = [[name, result["target_step"][name], result["target_verify5"][name]] for name in result["target_step"]]
        if models.draft is not None:
            kind = "a feature draft's propose call, 1 guess" if models.feature_draft else "draft step"
            rows.append([f"{kind} (1 token, 1 thread, {result['draft_weights']} weights)",
                         result["draft_step"]["whole forward"], "-"])
            progress.print("... a propose round trip over gRPC ...")
            progress.phase("profile: a propose round trip over gRPC")
            result["rpc"] = rpc_round_trip(models, result["draft_propose_ms"], progress=progress,
                                           feature_width=result["draft_feature_width"])
            rows += [[f"draft propose γ=4: {k}", v, "-"] for k, v in result["rpc"].items()]
    headers = ["component", "1-token step ms", "5-token verify ms"]
    print("\n" + report.table(headers, rows), flush=True)
    result["table_markdown"] = report.markdown_table(headers, rows)
    parts = [k for k in result["target_step"] if k != "whole forward"]
    report.plot_stacked(out_dir / "profile.png", f"One target forward, {models.label} ({models.dtype}), batch 1",
                        "ms", ["1-token step", "5-token verify"],
                        {k: [result["target_step"][k], result["target_verify5"][k]] for k in parts})
    report.write_json(out_dir / "profile.json", result)
    print(f"\nwrote {out_dir / 'profile.json'}, {out_dir / 'profile.png'}", flush=True)
    return result
