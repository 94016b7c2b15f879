"""A feature draft served (draft_service/feature.py, the target's side in target_service/drafting.py
and engine.py): the target's features cross the wire bit for bit; features of the wrong dtype,
width or count are refused naming the field, and a draft asking for layers the target does not
have is refused at connect; greedy output with the feature draft, alone or behind prompt lookup,
is the target's plain greedy output, and coupled sampling its plain sampled output; a draft that
loses its state gets every feature again and drafts on.

The pair: the model zoo's tiny target and a feature head for it, trained for a few steps on the
target's own greedy answers to the tests' prompts (so that guesses are accepted, often but not
always: the tests check they were)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from tests.support.engine_harness import naive_greedy, run_engine, speculation
from tests.support.feature_pair import PROMPTS, train_feature_pair

from draft_service.combined import NgramPlusModelProposer
from draft_service.feature import FeatureProposer
from specstream.data.propose import ProposeItem
from specstream.data.sampling import SamplingParams
from specstream.models.feature_draft import load_feature_draft
from specstream.models.loader import load_model
from specstream_pb import draft_pb2
from specstream.data.propose_wire import item_from_pb, item_to_pb
from target_service.draft_client import DraftClient
from target_service.drafting import feature_refusal
from target_service.engine import feature_bytes
from target_service.local_draft import LocalDraft


@pytest.fixture(scope="module")
def fused_pair(model_zoo, tmp_path_factory) -> dict[str, Path]:
    """A draft reading the target's layer 1 and its final state (of 3 layers)."""
    return train_feature_pair(model_zoo, tmp_path_factory.mktemp("fused") / "draft", extra_layers=(1,))


def _proposer(feature_pair, slots: int = 16) -> FeatureProposer:
    return FeatureProposer(load_feature_draft(feature_pair["draft"], Path), slots, 512)


def _features(n: int, width: int, seed: int = 0) -> bytes:
    return feature_bytes(torch.randn(n, width, generator=torch.Generator().manual_seed(seed)))


# ----- transport ----------------------------------------------------------------------------------

def test_features_cross_the_wire_bit_for_bit() -> None:
    """The engine's bytes of bfloat16 features (every kind of value: signed zeros, subnormals,
    infinities, NaN payloads) -> the target's ProposeItem message -> bytes on the wire -> the
    draft's ProposeItem -> the tensor the draft reads: the same bits."""
    width = 64
    bits = torch.randint(-2**15, 2**15, (7, width), dtype=torch.int16, generator=torch.Generator().manual_seed(3))
    bits[0, :4] = torch.tensor([0, -2**15, 1, 0x7F80], dtype=torch.int16)  # +0, -0, a subnormal, +inf
    hidden = bits.view(torch.bfloat16)
    item = ProposeItem(42, 3, [1, 2, 3, 4, 5, 6, 7], 4, features=feature_bytes(hidden), feature_width=width)
    wire = item_to_pb(item, "").SerializeToString()
    got = item_from_pb(("stream", 42), draft_pb2.ProposeItem.FromString(wire))
    assert (got.feature_width, got.feature_dtype) == (width, "bfloat16")
    decoded = torch.frombuffer(bytearray(got.features), dtype=torch.bfloat16).view(7, width)
    assert torch.equal(decoded.view(torch.int16), bits)


# ----- bad input ----------------------------------------------------------------------------------

def test_features_of_the_wrong_dtype_width_or_count_are_refused_naming_the_field(feature_pair) -> None:
    proposer = _proposer(feature_pair)
    H = proposer.feature_width
    good = ProposeItem("good", 0, [5, 6, 7], 3, features=_features(2, H), feature_width=H)
    nan = bytearray(_features(2, H))
    nan[10:12] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    inf = bytearray(_features(2, H))  # -inf in the last number: every position is checked
    inf[-2:] = torch.tensor([float("-inf")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    bad = {
        "ProposeItem.feature_dtype='float16'": ProposeItem("a", 0, [5, 6, 7], 3, features=_features(2, H),
                                                           feature_width=H, feature_dtype="float16"),
        f"ProposeItem.feature_width={H - 1}": ProposeItem("b", 0, [5, 6, 7], 3, features=_features(2, H - 1),
                                                          feature_width=H - 1),
        "ProposeItem.features: 0 bytes": ProposeItem("c", 0, [5, 6, 7], 3, feature_width=H),
        f"ProposeItem.features: {3 * H * 2} bytes": ProposeItem("d", 0, [5, 6, 7], 3, features=_features(3, H),
                                                                feature_width=H),
        "ProposeItem.features: sequence e has numbers that are not finite": ProposeItem(
            "e", 0, [5, 6, 7], 3, features=bytes(nan), feature_width=H),
        "ProposeItem.features: sequence f has numbers that are not finite": ProposeItem(
            "f", 0, [5, 6, 7], 3, features=bytes(inf), feature_width=H),
    }
    for combined in (False, True):
        p = NgramPlusModelProposer(_proposer(feature_pair), 16) if combined else proposer
        replies = p.propose([good, *bad.values()])
        assert len(replies[0].tokens) == 3 and replies[0].length == 3 and not replies[0].error
        for (expected, item), reply in zip(bad.items(), replies[1:]):
            assert reply.error.startswith(expected), (expected, reply.error)
            assert (reply.tokens, reply.length) == ([], 0)
            assert item.key not in getattr(p, "model", p).slots  # nothing held: the next item resends it whole
        # The good sequence goes on from where it was.
        more = p.propose([ProposeItem("good", 3, [8], 2, features=_features(1, H, 1), feature_width=H)])[0]
        assert more.length == 4 and len(more.tokens) == 2 and not more.error


def test_a_target_refuses_a_draft_asking_for_features_it_does_not_send(feature_pair, model_zoo) -> None:
    assert feature_refusal([], 0, 3, 64) == ""
    assert feature_refusal([3], 64, 3, 64) == ""
    assert feature_refusal([1, 3], 128, 3, 64) == ""  # EAGLE-3's fusion: an earlier layer, then the final
    for layers in ([2], [1, 2], [3, 1], [1, 1, 3], [0, 3], [1, 4]):
        assert feature_refusal(layers, 64 * len(layers), 3, 64).startswith(
            f"DraftInfo.feature_layers={layers}: this target sends its final, normed hidden state (layer 3)"), layers
    assert feature_refusal([3], 32, 3, 64).startswith("DraftInfo.feature_width=32")
    assert feature_refusal([1, 3], 64, 3, 64).startswith("DraftInfo.feature_width=64: this target's features of 2 "
                                                         "layers have 128 numbers")
    assert feature_refusal([3], 0, 3, 64).startswith("DraftInfo.feature_layers=[3] with DraftInfo.feature_width=0")
    # In the target's process: the engine refuses it when it is built.
    from specstream.data.config import ModelSpec, TargetConfig
    from target_service.engine import Engine

    shallower = load_model(model_zoo["partial"])  # the same width, fewer layers
    layers = shallower.config.num_layers
    assert layers != 3
    with pytest.raises(ValueError, match=rf"DraftInfo.feature_layers=\[3\]: this target sends .* \(layer {layers}\)"):
        Engine(shallower, TargetConfig(model=ModelSpec(str(model_zoo["partial"])), calibrate=False),
               LocalDraft(_proposer(feature_pair)))

    async def connect(layers: int) -> tuple[bool, str, int]:
        from test_draft_client import _draft_server

        server, url, compute = await _draft_server(_proposer(feature_pair))
        client = DraftClient(url, 2.0, 0.2, target_layers=layers, target_width=64)
        try:
            return await client.fetch_info(), client.refused, client.feature_width
        finally:
            await client.close()
            await server.stop(None)
            compute.shutdown()

    ok, refused, width = asyncio.run(connect(3))
    assert (ok, refused, width) == (True, "", 64)
    ok, refused, width = asyncio.run(connect(5))
    assert not ok and refused.startswith("DraftInfo.feature_layers=[3]: this target sends its final, normed hidden "
                                         "state (layer 5)"), refused


# ----- exactness ----------------------------------------------------------------------------------

@pytest.mark.parametrize("combined", [False, True], ids=["feature", "ngram+feature"])
@pytest.mark.parametrize("gamma", [3, None], ids=["fixed3", "auto"])
def test_greedy_with_the_feature_draft_is_plain_greedy(feature_pair, combined, gamma) -> None:
    target = feature_pair["target"]
    proposer = _proposer(feature_pair)
    if combined:
        proposer = NgramPlusModelProposer(proposer, 16, min_n=2)
    # Under auto without start-up timing, the first pass guesses the configured γ before any cost
    # is known; timed on a loaded machine, the controller could find that no guess pays on these
    # short requests and never propose, leaving nothing to check.
    got, finals = run_engine(target, None, PROMPTS, gamma=gamma, max_new_tokens=[30, 41, 25, 36],
                             proposer=proposer, config={"calibrate": False})
    for prompt, tokens, budget in zip(PROMPTS, got, [30, 41, 25, 36]):
        assert tokens == naive_greedy(target, prompt, budget)
    # Guesses were accepted, and rejected too (rollbacks exercised). Under auto the controller's
    # schedule follows measured step times (and may buy branches), so only a fixed γ's share is
    # the same every run.
    accepted, drafted = (sum(f.stats.accepted_tokens for f in finals), sum(f.stats.draft_tokens for f in finals))
    assert accepted > (0.2 * drafted if gamma else 0) and drafted > 0
    assert sum(f.stats.rejections for f in finals) > 0


@pytest.mark.parametrize("layout", ["colocated", "draft-service"])
def test_a_draft_reading_several_layers_is_exact_in_both_layouts(fused_pair, layout) -> None:
    """EAGLE-3's fusion: the draft reads the target's layer 1 (RMS-normalized) and its final state;
    the target sends both per position, in its own process or over gRPC, and greedy output is plain
    greedy's with guesses accepted."""
    from specstream.data.config import ModelSpec, TargetConfig
    from specstream.data.engine import SequenceRequest
    from target_service.engine import Engine
    from target_service.inprocess import generate

    target = fused_pair["target"]
    proposer = _proposer(fused_pair)
    assert (proposer.feature_layers, proposer.feature_width) == ((1, 3), 128)
    budgets = [30, 41, 25, 36]
    requests = [SequenceRequest(str(i), list(p), n, speculation=speculation(3))
                for i, (p, n) in enumerate(zip(PROMPTS, budgets))]

    async def main():
        from test_draft_client import _draft_server

        server = compute = None
        if layout == "colocated":
            source = LocalDraft(proposer)
        else:
            server, url, compute = await _draft_server(proposer)
            source = DraftClient(url, 5.0, 0.2, target_layers=3, target_width=64)
            assert await source.wait_connected(5.0) and source.feature_width == 128
        engine = Engine(load_model(target), TargetConfig(model=ModelSpec(str(target)), max_slots=8, max_seq_len=512,
                                                         max_gamma=8, calibrate=False), source)
        loop_task = asyncio.create_task(engine.run())
        try:
            return await generate(engine, requests, 60)
        finally:
            loop_task.cancel()
            await source.close()
            if server is not None:
                await server.stop(None)
                compute.shutdown()

    results = asyncio.run(main())
    for prompt, result, budget in zip(PROMPTS, results, budgets):
        assert result.token_ids == naive_greedy(target, prompt, budget)
    finals = [r.final for r in results]
    assert sum(f.stats.accepted_tokens for f in finals) > 0.2 * sum(f.stats.draft_tokens for f in finals) > 0


def test_coupled_sampling_with_the_feature_draft_is_plain_sampling(feature_pair) -> None:
    """Sampled items get q from the head (processed and cut as the token draft's); with coupled
    verification the output is plain sampling's, token for token (docs/architecture.md §7.1)."""
    target = feature_pair["target"]
    sampling = [SamplingParams.from_settings(0.8, top_p=0.95, seed=s) for s in range(len(PROMPTS))]
    config = {"speculative_sampling": "coupled"}
    plain, _ = run_engine(target, None, PROMPTS, gamma=0, max_new_tokens=32, sampling=sampling, config=config)
    spec, finals = run_engine(target, None, PROMPTS, gamma=3, max_new_tokens=32, sampling=sampling, config=config,
                              proposer=_proposer(feature_pair))
    assert spec == plain
    assert sum(f.stats.accepted_tokens for f in finals) > 0


class _Forgetful(LocalDraft):
    """A local feature draft that loses every sequence's state (a new stream: epoch + 1) after
    ``after`` propose calls, and records each call's items."""

    def __init__(self, proposer, after: int) -> None:
        super().__init__(proposer)
        self.after, self.calls, self.epoch = after, [], 1

    async def propose(self, step, items, traceparent="", item_traceparents=None):
        self.calls.append([(it.key, it.rollback_to, len(it.append), len(it.features)) for it in items])
        if len(self.calls) == self.after:
            self.proposer.release(list(self.proposer.slots))
            self.epoch += 1
            return None  # this step decodes plainly, as after a broken stream
        return await super().propose(step, items, traceparent, item_traceparents)


def test_a_draft_that_lost_its_state_gets_every_feature_again_and_drafts_on(feature_pair, monkeypatch) -> None:
    from tests.support import engine_harness
    target = feature_pair["target"]
    draft = _Forgetful(_proposer(feature_pair), after=6)
    monkeypatch.setattr(engine_harness, "LocalDraft", lambda proposer, **kwargs: draft)
    got, finals = run_engine(target, None, PROMPTS[:2], gamma=3, max_new_tokens=40, proposer=object())
    assert got == [naive_greedy(target, p, 40) for p in PROMPTS[:2]]
    resent = [c for call in draft.calls[6:7] for c in call]
    # The call after the loss sends each sequence whole: from 0, every feature (one per token but the first).
    assert resent and all(rollback == 0 and size == (n - 1) * 64 * 2 for _, rollback, n, size in resent), resent
    # Then it holds them again: later items go on from what it holds, and guesses are accepted.
    assert any(rollback > 0 for call in draft.calls[7:] for _, rollback, _, _ in call)
    assert sum(f.stats.accepted_tokens for f in finals) > 0


def test_the_pipeline_writes_a_loadable_draft_and_its_card(feature_pair, tmp_path) -> None:
    """train-draft --kind feature's last stages: the trained head (as the train stage saves it)
    exported as a feature draft in 4 bits that loads with the head's rounded weights and drafts,
    and a model card that states the log's figures."""
    import json

    from safetensors.torch import save_file

    from tools.distill.feature import export_head, read_head, write_card

    source = load_feature_draft(feature_pair["draft"], Path)
    head_path = tmp_path / "head.safetensors"
    save_file({k: v.contiguous() for k, v in source.head.state_dict().items()}, str(head_path),
              metadata={"spec": json.dumps(source.head.spec.to_json())})
    out = tmp_path / "tiny-feature"
    export_head(read_head(head_path, []), out, str(feature_pair["target"]), feature_pair["target"])
    again = load_feature_draft(out, Path)
    # Stored in the 4 bits a CPU serves it with: each matrix the int4 kernel takes is the round-to-
    # nearest of its bfloat16 values, the others are those values.
    from kernels.int4 import Q4Weight, q4_dense, q4_native, q4_rounded_native, rtn_parts

    rounded = 0
    for name in source.head.matrices:
        w = getattr(source.head, name).weight.detach().to(torch.bfloat16).float()
        if Q4Weight.fits(*w.shape):
            w, rounded = q4_dense(*rtn_parts(w), torch.float32), rounded + 1
        assert torch.equal(getattr(again.head, name).weight, w), name
    assert rounded >= 4
    # weights="auto" serves those very blocks where the 4-bit kernel takes the activations' dtype
    # (float32: AVX2), and the dense values elsewhere; their inputs rounded to 16 bits as a target's
    # where the native kernel can (auto's choice for a target: loader.activation_bits).
    served = load_feature_draft(out, Path, dtype="float32", weights="auto")
    assert served.weights.startswith("int4") == q4_native(torch.float32), served.weights
    sixteen = q4_rounded_native(torch.float32, 16)
    assert served.weights.startswith("int4-a16") == sixteen and served.head._bits == 16 * sixteen, served.weights
    assert served.output.bits == 16 * sixteen
    assert load_feature_draft(out, Path, dtype="float32", weights="int4").head._bits == 0
    if q4_native(torch.float32):
        for name in source.head.matrices:
            kept = served.head._served[name]
            if isinstance(kept, Q4Weight):
                assert torch.equal(q4_dense(*kept.parts(), torch.float32), again.head.state_dict()[f"{name}.weight"])
    item = ProposeItem("k", 0, PROMPTS[1], 3, features=_features(len(PROMPTS[1]) - 1, 64), feature_width=64)
    assert len(FeatureProposer(again, 2, 64).propose([item])[0].tokens) == 3
    log = {"response_tokens": 1234, "generate_minutes": 1.0, "features_minutes": 0.5,
           "train": {"spec": source.head.spec.to_json(), "epochs": [{"alpha": 0.312}, {"alpha": 0.401}], "steps": 7,
                     "minutes": 2.0, "train_answers": 3, "train_positions": 99},
           "measure": {"all": {"alpha": 0.456, "tokens_per_pass": 1.79}, "code": {"alpha": 0.5, "tokens_per_pass": 2.0}},
           "served": {"feature (model)": {"alpha": 0.321, "mean_accepted_length": 1.5, "prompts": 9,
                                          "max_new_tokens": 96, "gamma": 4}},
           "costs": {"context": 200, "draft_call_ms": {"1": 0.5, "4": 2.0}, "target_ms": 6.0, "c": 0.083},
           "served_structured": {"feature": {"alpha": 0.7, "mean_accepted_length": 3.61, "prompts": 126, "gamma": 4,
                                             "by_domain": {"tool": {"prompts": 30, "mean_accepted_length": 4.8}}}}}
    write_card(out, log)
    card = (out / "README.md").read_text()
    for figure in ("0.312 / 0.401", "**0.456**, 1.79", "code 0.50", "this draft, alone | **0.321**, 1.50",
                   "c = **0.083**", "of 1,234 in all", "(stage `structured`) | **3.61** tokens per target pass",
                   "by family: tool 4.80"):
        assert figure in card, figure
    assert json.loads((out / "train_log.json").read_text())["costs"]["c"] == 0.083


class _Recording(LocalDraft):
    """A local draft that records every call's items: (rollback_to, len(append), γ, feature bytes)."""

    def __init__(self, proposer) -> None:
        super().__init__(proposer)
        self.calls, self.item_keys = [], []

    async def propose(self, step, items, traceparent="", item_traceparents=None):
        self.calls.append([(it.rollback_to, len(it.append), it.gamma, len(it.features)) for it in items])
        self.item_keys.append([(it.key,) for it in items])
        return await super().propose(step, items, traceparent, item_traceparents)


def test_a_sync_larger_than_a_call_goes_in_parts(feature_pair, monkeypatch) -> None:
    """With room for 4 features a call, a prompt's features go over several steps (those rows guess
    nothing until their draft holds everything), no call carries more, and the output is plain."""
    from tests.support import engine_harness
    import target_service.drafting as drafting

    monkeypatch.setattr(drafting, "FEATURE_BYTES_PER_CALL", 4 * 64 * 2)
    draft = _Recording(_proposer(feature_pair))
    monkeypatch.setattr(engine_harness, "LocalDraft", lambda proposer, **kwargs: draft)
    target = feature_pair["target"]
    got, finals = run_engine(target, None, PROMPTS, gamma=3, max_new_tokens=30, proposer=object())
    assert got == [naive_greedy(target, p, 30) for p in PROMPTS]
    assert all(sum(size for *_, size in call) <= 4 * 64 * 2 for call in draft.calls)
    parts = [item for call in draft.calls for item in call if item[2] == 0]
    assert parts and all(size == (n - (rollback == 0)) * 64 * 2 for rollback, n, _, size in parts), parts
    assert sum(f.stats.accepted_tokens for f in finals) > 0


def test_a_refused_sequence_decodes_without_the_draft_and_is_not_resent(feature_pair, monkeypatch) -> None:
    """A draft that refuses a sequence's features once: that sequence goes on plainly (no more items
    for it), the others keep drafting, and every output is plain greedy."""
    from tests.support import engine_harness
    class Refusing(_Recording):
        async def propose(self, step, items, traceparent="", item_traceparents=None):
            replies = await super().propose(step, items, traceparent, item_traceparents)
            for item, reply in zip(items, replies):
                if item.key == first_key and len(self.calls) == 3:
                    reply.tokens, reply.length, reply.error = [], 0, "ProposeItem.features: refused by the test"
            return replies

    first_key = 1  # the engine's first request's sequence
    draft = Refusing(_proposer(feature_pair))
    monkeypatch.setattr(engine_harness, "LocalDraft", lambda proposer, **kwargs: draft)
    target = feature_pair["target"]
    got, finals = run_engine(target, None, PROMPTS[:2], gamma=3, max_new_tokens=30, proposer=object())
    assert got == [naive_greedy(target, p, 30) for p in PROMPTS[:2]]
    keys = [[key for key, *_ in call] for call in draft.item_keys]
    assert any(first_key in k for k in keys[:3]) and not any(first_key in k for k in keys[3:])
    assert any(k for k in keys[3:])  # the other sequence still drafts


def test_a_shipped_draft_is_named_by_its_directory_name() -> None:
    from specstream.models.registry import DRAFTS, resolve_model

    assert resolve_model("smollm2-135m-feature") == DRAFTS / "smollm2-135m-feature"
    with pytest.raises(Exception, match=r"a shipped draft \(\['smollm2-135m-draft', 'smollm2-135m-feature'\]\)"):
        resolve_model("smollm2-135m-nothing")


def test_the_pipeline_trains_and_measures_a_fused_aligned_variant_on_part_of_the_data(model_zoo, tmp_path) -> None:
    """`train-draft --kind feature --extra-layers 1 --aligned --train-fraction 0.5 --stage features
    --stage train --stage offline` on a tiny target's answers: the features hold the extra layer
    beside the final state, the head trains on half the training answers, and the offline stage
    measures it per domain."""
    from safetensors.torch import load_file

    from tools.distill.data import Record, save_records
    from tools.distill.feature import FeatureConfig, main
    from tools.distill.pipeline import write_prompts

    target, work = model_zoo["target"], tmp_path / "work"
    prompts, records = [], []
    for i, prompt in enumerate(PROMPTS * 3):
        split = "held_out" if i % 4 == 3 else "train"
        response = naive_greedy(target, prompt, 20)
        prompts.append({"id": i, "domain": ("code", "math")[i // 4 % 2], "split": split, "messages": []})
        top = torch.tensor([[t] * 32 for t in response], dtype=torch.int32)  # [len, 32]: its first choices
        records.append(Record(i, split, False, list(prompt), response, top, torch.zeros(len(response), 32)))
    write_prompts(work / "prompts.jsonl.gz", prompts)
    save_records(records, work / "records.safetensors")
    cfg = FeatureConfig(epochs=1, vocab_out=64, batch_tokens=32, dtype="float32", extra_layers=(1,), aligned=True,
                        train_fraction=0.5)
    log = main(target, work, cfg, ("features", "train", "offline"), tmp_path / "out", target_ref=str(target))
    features = load_file(str(work / "features.safetensors"))
    positions = sum(len(r.prompt) + len(r.response) for r in records)
    assert features["features"].shape == (positions, 64) and features["layers"].shape == (positions, 64)
    assert log["train"]["train_answers"] == round(0.5 * sum(r.split == "train" for r in records))
    assert list(log["train"]["spec"]["extra_layers"]) == [1] and log["train"]["steps"] > 0
    assert set(log["measure"]) == {"all", "code", "math"} and log["measure"]["all"]["rounds"] > 0
    # --head-vocab: the same weights scoring the tokens the training answers start with most often
    from collections import Counter

    from tools.distill.feature import read_head

    full, narrow = read_head(work / "head.safetensors", records), read_head(work / "head.safetensors", records, 5)
    counts = Counter(t for r in records if r.split == "train" for t in r.response)
    top = sorted(set(full.output_ids.tolist()), key=lambda t: (-counts.get(t, 0), t))[:5]
    assert narrow.output_ids.tolist() == sorted(top) and narrow.spec.vocab_out == 5
    assert torch.equal(narrow.q.weight, full.q.weight)
    with pytest.raises(ValueError, match="head_vocab=65"):
        read_head(work / "head.safetensors", records, 65)



def test_a_further_training_starts_from_a_drafts_weights_and_keeps_its_vocabulary(feature_pair) -> None:
    """``--init-from``: the head starts from the draft's stored weights (its 4-bit matrices as they
    dequantize), and its vocabulary is the draft's followed by the answers' most frequent others."""
    import dataclasses
    import json

    from specstream.models.feature_draft import dense_head_state
    from specstream.models.feature_head import FeatureHead, HeadSpec
    from tools.distill.data import Record
    from tools.distill.feature import _output_ids, _start_from

    draft = feature_pair["draft"]
    stored = dense_head_state(draft)
    spec = HeadSpec(**json.loads((draft / "config.json").read_text())["specstream"]["head"])
    head = FeatureHead(dataclasses.replace(spec, vocab_out=spec.vocab_out + 2))
    kept = _start_from(head, draft)
    assert torch.equal(kept, stored["output_ids"]) and torch.equal(head.q.weight, stored["q.weight"])
    vocab = int(kept.max()) + 4  # (the tiny pair's draft scores its whole vocabulary)
    outside = [vocab - 3, vocab - 2, vocab - 1]
    answers = [outside[2]] * 5 + [outside[0]] * 3 + [outside[1]] + kept[:4].tolist() * 9  # by count: 2, 0, 1
    top = torch.tensor([[t] * 32 for t in answers], dtype=torch.int32)
    records = [Record(0, "train", False, [1], answers, top, torch.zeros(len(answers), 32))]
    ids = _output_ids(records, vocab, len(kept) + 2, kept)
    assert sorted(ids.tolist()) == sorted(kept.tolist() + [outside[2], outside[0]])
    with pytest.raises(ValueError, match=f"vocab_out={len(kept) - 1}"):
        _output_ids(records, vocab, len(kept) - 1, kept)

def test_the_benchmarks_run_a_feature_draft_and_give_transformers_the_token_draft(feature_pair, model_zoo) -> None:
    """A benchmarked pair whose draft reads features (the default pair's kind): transformers, which
    cannot feed it features, gets the pair's token draft as its assistant model (without one, no
    assisted rows); the draft's cost is a guess as it serves, and the γ benchmark's proposers run it."""
    import dataclasses

    from tools.bench.costs import measure_costs
    from tools.bench.gamma import _Models
    from tools.bench.hf import runnable_modes
    from tools.bench.models import BenchModels

    models = BenchModels("tiny", feature_pair["target"], feature_pair["draft"], "float32")
    assert models.feature_draft and models.assistant is None
    assert runnable_modes(models) == ("plain", "prompt_lookup")
    paired = dataclasses.replace(models, token_draft=model_zoo["partial"])
    assert paired.assistant == model_zoo["partial"] and runnable_modes(paired)[:3] == ("plain", "assisted",
                                                                                      "assisted_heuristic")
    assert not dataclasses.replace(models, draft=model_zoo["partial"]).feature_draft
    costs = measure_costs(models, 16, [2])
    assert costs["draft_step_ms"] > 0 and costs["c"] > 0
    proposer = _Models(models).proposer("ngram+model", 2, 64)
    assert isinstance(proposer, NgramPlusModelProposer) and isinstance(proposer.model, FeatureProposer)
