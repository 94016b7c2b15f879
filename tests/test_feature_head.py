"""The EAGLE-style head (specstream/models/feature_head.py): its forward equals a direct reference
written from its weights; drafting from every start at once equals drafting from one start step by
step, and serving incrementally drafts the same; a few training steps on a tiny target lower the loss."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tests.support.hardware import NEEDS_Q4_NATIVE, NEEDS_Q4_NATIVE_F32

from specstream.models.feature_head import FeatureHead, HeadSpec

SPEC = HeadSpec(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, rope_theta=10000.0, norm_eps=1e-5,
                vocab_out=20)


def _head(seed: int = 0, spec: HeadSpec = SPEC) -> tuple[FeatureHead, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    head = FeatureHead(spec)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    head.output_ids.copy_(torch.arange(5, 25))  # scores ids 5..24 of a 30-token vocabulary
    embed = torch.randn(30, 32)  # [V, H]
    return head, embed, embed[head.output_ids]


def _step_by_step(head, feats, tokens, embed, rows, t: int, steps: int) -> list[int]:
    """One round from start t, each step a teacher-forced forward over the explicit sequence of
    fused inputs: the true (f_i, x_{i+1}) up to t, then the head's own (g, chosen token)."""
    f, e = list(feats[:t + 1]), [embed[int(x)] for x in tokens[1:t + 2]]
    chosen = []
    for _ in range(steps):
        g = head(torch.stack(f)[None], torch.stack(e)[None])[0, -1]  # [H]
        token = int(head.output_ids[head.logits(g, rows).argmax()])
        chosen.append(token)
        f.append(g)
        e.append(embed[token])
    return chosen


def test_chain_from_every_start_equals_drafting_one_start_step_by_step() -> None:
    head, embed, rows = _head()
    gen = torch.Generator().manual_seed(1)
    T = 12
    feats = torch.randn(T, 32, generator=gen)
    tokens = torch.randint(0, 30, (T + 1,), generator=gen)
    with torch.no_grad():
        logits, drafted = head.chain_logits(feats, tokens, embed, rows, steps=4)
        assert logits.shape == (4, T, 20) and drafted.shape == (4, T)
        # step 1 from every start is the teacher-forced forward
        assert torch.allclose(logits[0], head.logits(head(feats[None], embed[tokens[1:]][None])[0], rows), atol=1e-5)
        for t in (0, 3, 7, 11):
            assert drafted[:, t].tolist() == _step_by_step(head, feats, tokens, embed, rows, t, 4), t


def test_chain_with_given_tokens_feeds_them() -> None:
    head, embed, rows = _head(2)
    gen = torch.Generator().manual_seed(3)
    feats = torch.randn(9, 32, generator=gen)
    tokens = torch.randint(0, 30, (10,), generator=gen)
    chosen = torch.randint(0, 30, (2, 9), generator=gen)
    with torch.no_grad():
        fed, _ = head.chain_logits(feats, tokens, embed, rows, steps=3, chosen=chosen)
        free, drafted = head.chain_logits(feats, tokens, embed, rows, steps=3)
        again, _ = head.chain_logits(feats, tokens, embed, rows, steps=3, chosen=drafted[:2])
    assert torch.equal(fed[0], free[0])  # step 1 has no chosen token
    assert not torch.allclose(fed[1], free[1])  # the random tokens were used
    assert torch.allclose(again, free, atol=1e-6)  # feeding its own choices is drafting


def test_a_few_training_steps_on_a_tiny_target_lower_the_loss(tmp_path) -> None:
    """The training stage's loss (tools.distill.feature.head_loss: KL to the target over
    the head's vocabulary, STEPS drafting steps on its own features) on a tiny random target's real
    features of a few sequences: 30 AdamW steps lower it."""
    from specstream.models.loader import load_model
    from specstream.models.random_init import write_random_checkpoint
    from tools.distill.feature import FeatureConfig, _spec, head_loss

    config = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
    target = load_model(write_random_checkpoint(tmp_path / "t", config, seed=3), dtype="float32")
    gen = torch.Generator().manual_seed(4)
    sequences = []
    with torch.no_grad():
        for _ in range(4):
            tokens = torch.randint(0, 64, (24,), generator=gen)
            cache = target.new_cache(1, 24)
            feats = target.hidden(tokens[None], cache, torch.tensor([cache.alloc()]), torch.tensor([0]))[0]
            sequences.append((tokens, feats))
    torch.manual_seed(0)
    head = FeatureHead(_spec(target.config, 32))
    head.output_ids.copy_(torch.arange(32))
    embed = target.embed.detach()
    rows = embed[head.output_ids]
    cfg = FeatureConfig()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)

    def loss() -> torch.Tensor:
        total, terms = zip(*(head_loss(head, f, f, t, embed, rows, 4, cfg) for t, f in sequences))
        return sum(total) / sum(terms)

    with torch.no_grad():
        before = loss().item()
    for _ in range(30):
        opt.zero_grad()
        loss().backward()
        opt.step()
    with torch.no_grad():
        after = loss().item()
    assert after < 0.8 * before, (before, after)


def test_serving_incrementally_drafts_what_the_chain_drafts() -> None:
    """A sequence fed to the head's cache in rounds (``extend`` with the target's features, then
    ``draft``, its guesses overwritten by the next round) proposes, from each start, what
    ``chain_logits`` drafts from that start."""
    from specstream.models.feature_head import HeadCache

    head, embed, rows = _head(5)
    gen = torch.Generator().manual_seed(6)
    T = 14
    feats = torch.randn(T, 32, generator=gen)
    tokens = torch.randint(0, 30, (T + 1,), generator=gen)
    cache = HeadCache(SPEC, slots=2, max_len=32)
    with torch.no_grad():
        _, drafted = head.chain_logits(feats, tokens, embed, rows, steps=3)
        at = 0
        for end in (5, 6, 9, 14):  # rounds committing 5, 1, 3 and 5 positions
            out = head.extend(cache, 1, at, feats[at:end], embed[tokens[at + 1:end + 1]])
            guesses = head.draft(cache, 1, out[-1], 3, embed, rows)
            assert guesses == drafted[:, end - 1].tolist(), end
            assert cache.length[1] == end
            at = end


def _reference_forward(head: FeatureHead, feats: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """The head's layer written out position by position in float64, from its weights alone: the
    target layers' fusion (EAGLE-3, with extra layers), the fusion with the embedding, RMS norm,
    RoPE (rotate-half, at position i + 1), grouped causal attention, SwiGLU."""
    s = head.spec
    W = {k: v.detach().double() for k, v in head.state_dict().items() if v.is_floating_point()}
    T, D, kvh = feats.shape[0], s.head_dim, s.kv_heads
    group = s.heads // kvh

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean() + s.norm_eps)

    def rope(v, pos):
        out = torch.empty_like(v)
        for j in range(D // 2):
            angle = pos * s.rope_theta ** (-2 * j / D)
            c, si = math.cos(angle), math.sin(angle)
            out[j] = v[j] * c - v[j + D // 2] * si
            out[j + D // 2] = v[j + D // 2] * c + v[j] * si
        return out

    xs, qs, ks, vs = [], [], [], []
    for i in range(T):
        f = W["reduce.weight"] @ feats[i].double() if "reduce.weight" in W else feats[i].double()
        x = W["fuse.weight"] @ torch.cat((f, embeds[i].double()))
        h = rms(x, W["input_norm"])
        q = (W["q.weight"] @ h).view(s.heads, D)
        kv = (W["kv.weight"] @ h).view(2 * kvh, D)
        xs.append(x)
        qs.append([rope(q[j], i + 1) for j in range(s.heads)])
        ks.append([rope(kv[j], i + 1) for j in range(kvh)])
        vs.append([kv[kvh + j] for j in range(kvh)])
    out = []
    for i in range(T):
        heads = []
        for j in range(s.heads):
            scores = torch.stack([qs[i][j] @ ks[t][j // group] for t in range(i + 1)]) / math.sqrt(D)
            w = torch.softmax(scores, 0)
            heads.append(sum(w[t] * vs[t][j // group] for t in range(i + 1)))
        x = xs[i] + W["o.weight"] @ torch.cat(heads)
        gate_up = W["gate_up.weight"] @ rms(x, W["post_norm"])
        gate, up = gate_up[: s.intermediate], gate_up[s.intermediate:]
        out.append(x + W["down.weight"] @ (torch.nn.functional.silu(gate) * up))
    return torch.stack(out)


@pytest.mark.parametrize("extra_layers", [(), (1, 3)])
def test_the_head_forward_matches_a_direct_reference_on_random_weights(extra_layers) -> None:
    spec = dataclasses.replace(SPEC, extra_layers=extra_layers)
    head, embed, _ = _head(7, spec)
    assert (head.reduce is not None) == bool(extra_layers)
    gen = torch.Generator().manual_seed(8)
    feats = torch.randn(9, spec.input_width, generator=gen)
    tokens = torch.randint(0, 30, (9,), generator=gen)
    with torch.no_grad():
        got = head(feats[None], embed[tokens][None])[0].double()  # [T, H]
    want = _reference_forward(head, feats, embed[tokens])
    assert want.abs().max() > 1.0  # not a degenerate layer
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_target_keeps_the_layers_a_feature_draft_reads_without_changing_its_output(tmp_path) -> None:
    """``hidden(keep=...)``: each kept layer's output RMS-normalized, then the final state, which is
    bit for bit what the target computes without keeping; kept outputs equal the layers run one by one."""
    from specstream.models.base import rms_norm
    from specstream.models.loader import load_model
    from specstream.models.random_init import write_random_checkpoint

    config = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
    target = load_model(write_random_checkpoint(tmp_path / "t", config, seed=5), dtype="float32")
    tokens = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(1))

    def run(**kw):
        cache = target.new_cache(1, 16)
        return target.hidden(tokens, cache, torch.tensor([cache.alloc()]), torch.tensor([0]), **kw)

    with torch.no_grad():
        plain, kept = run(), run(keep=(1, 3))
        assert kept.shape == (1, 11, 3 * 32)
        assert torch.equal(kept[..., 64:], plain)
        cache = target.new_cache(1, 16)
        batch = target._cache_batch(tokens, cache, torch.tensor([cache.alloc()]), torch.tensor([0]))
        x, cos, sin = target.embed_positions(tokens, batch)
        outs = []
        for layer in target.layers[:3]:
            x = layer(x, batch, cos, sin, None)
            outs.append(rms_norm(x, torch.ones(32), target.config.norm_eps))
        torch.testing.assert_close(kept[..., :32], outs[0])
        torch.testing.assert_close(kept[..., 32:64], outs[2])
        assert torch.equal(run(last_only=True, keep=(2,))[..., 32:], run(last_only=True))
    for bad in ((4,), (0,), (3, 1)):
        with pytest.raises(ValueError, match="keep="):
            run(keep=bad)


def test_aligned_training_counts_a_step_only_where_the_earlier_steps_chose_the_answer() -> None:
    """GRIFFIN's token alignment (FeatureConfig.aligned): from a start whose first guess is not the
    answer's token, the deeper steps add nothing to the loss; step 1 always counts."""
    from tools.distill.feature import STEPS, FeatureConfig, head_loss

    head, embed, rows = _head(9)
    gen = torch.Generator().manual_seed(10)
    feats = torch.randn(10, 32, generator=gen)
    # from x_2 on, tokens the head never proposes (it scores ids 5..24): every first guess misses
    tokens = torch.cat((torch.randint(5, 25, (2,), generator=gen), torch.randint(0, 5, (8,), generator=gen)))
    with torch.no_grad():
        every, _ = head_loss(head, feats, feats, tokens, embed, rows, 1, FeatureConfig())
        aligned, _ = head_loss(head, feats, feats, tokens, embed, rows, 1, FeatureConfig(aligned=True))
        first_only, _ = head_loss(head, feats, feats, tokens, embed, rows, 1, FeatureConfig(step_decay=0.0))
        # with the answer's own tokens where the head can propose them, deeper steps count somewhere
        _, drafted = head.chain_logits(feats[:9], tokens, embed, rows, STEPS)
        own = torch.cat((tokens[:2], drafted[0, :8]))  # x_{t+2} := step 1's choice from t
        reached, _ = head_loss(head, feats, feats, own, embed, rows, 1, FeatureConfig(aligned=True))
        own_first, _ = head_loss(head, feats, feats, own, embed, rows, 1, FeatureConfig(step_decay=0.0))
    assert reached > own_first
    torch.testing.assert_close(aligned, first_only)  # step_decay 0: 0 ** 0 = 1, step 1 alone
    assert every > 1.2 * aligned


def _serve_rounds(head, spec, slot, feats, tokens, embed16, rows) -> tuple[torch.Tensor, list[list[int]]]:
    """Four rounds of serving one sequence in ``slot`` of a fresh cache in the features' dtype:
    extend over the features of positions up to 17, 18, 23 and 40, then draft 3 guesses -> (the
    outputs of every extend [40, H], each round's guesses)."""
    from specstream.models.feature_head import HeadCache

    cache = HeadCache(spec, slots=3, max_len=64, dtype=feats.dtype)
    outs, drafted, at = [], [], 0
    with torch.no_grad():
        for end in (17, 18, 23, 40):
            out = head.extend(cache, slot, at, feats[at:end], embed16[tokens[at + 1:end + 1]])
            outs.append(out.float())
            drafted.append(head.draft(cache, slot, out[-1], 3, embed16, rows))
            at = end
    return torch.cat(outs), drafted


# The dtypes a head is served in, and how close two ways of computing its layer must agree in each.
SERVED = [pytest.param(torch.bfloat16, 0.03, id="bfloat16"), pytest.param(torch.float32, 1e-4, id="float32")]


@pytest.mark.parametrize(("dtype", "tol"), SERVED)
def test_a_served_head_attends_in_the_native_op_as_torch_does(monkeypatch, dtype, tol) -> None:
    """Served in bfloat16 or float32, the head's attention runs in the native op the target's
    layers use (RoPE at head position + 1, the cache write, attention over positions <= each one's):
    its outputs over rounds of extend and draft are torch's attention's within the dtype's rounding,
    and it drafts the same tokens."""
    from kernels import native

    assert native.library() is not None  # built by `make test` (tests/test_native_ops.py)
    spec = HeadSpec(hidden=64, heads=4, kv_heads=2, head_dim=64, intermediate=96, rope_theta=10000.0, norm_eps=1e-5,
                    vocab_out=20)  # head_dim 64: the op's AVX-512 path where the CPU has it
    head, _, _ = _head(11, spec)
    for p in head.parameters():
        p.data.mul_(0.5)
    embed = torch.randn(30, 64, generator=torch.Generator().manual_seed(13))  # [V, H]
    rows = embed[head.output_ids]
    head.serve(dtype, int4=False)
    gen = torch.Generator().manual_seed(12)
    feats = torch.randn(40, 64, generator=gen).to(dtype)
    tokens = torch.randint(0, 30, (41,), generator=gen)
    embed16 = embed.to(dtype)

    real, calls = native.library(), []

    class Spy:  # the library, counting the head's attention calls
        def __getattr__(self, name):
            return getattr(real, name)

        def attention(self, *args):
            calls.append(args[1].shape)
            return real.attention(*args)

    def rounds(native_op: bool):
        monkeypatch.setattr(native, "library", (lambda: Spy()) if native_op else (lambda: None))
        out = _serve_rounds(head, spec, 2, feats, tokens, embed16, rows.to(dtype))
        monkeypatch.undo()
        return out

    native_out, native_drafts = rounds(True)
    assert len(calls) == 4 + 4 * 2  # an extend and two drafting steps a round, each one call
    torch_out, torch_drafts = rounds(False)
    assert len(calls) == 12
    assert native_out.abs().max() > 0.5
    torch.testing.assert_close(native_out, torch_out, rtol=tol, atol=tol)
    assert native_drafts == torch_drafts


def _native_sized_head() -> tuple[HeadSpec, FeatureHead, torch.Tensor]:
    """A head whose matrices the native 4-bit kernel takes (64 wide, head size 64), its weights
    halved so that its outputs stay moderate, and an embedding [30, 64] for it."""
    spec = HeadSpec(hidden=64, heads=4, kv_heads=2, head_dim=64, intermediate=96, rope_theta=10000.0, norm_eps=1e-5,
                    vocab_out=20)
    head, _, _ = _head(21, spec)
    for p in head.parameters():
        p.data.mul_(0.5)
    return spec, head, torch.randn(30, 64, generator=torch.Generator().manual_seed(23))


@pytest.mark.parametrize(("dtype", "tol"), [pytest.param(*p.values, marks=mark, id=p.id)
                                            for p, mark in zip(SERVED, (NEEDS_Q4_NATIVE, NEEDS_Q4_NATIVE_F32))])
def test_a_served_4_bit_head_runs_its_layer_as_one_native_call_as_op_by_op_does(dtype, tol) -> None:
    """Served in bfloat16 or float32 with 4-bit projections, the head's layer runs as one call of
    the native op that runs the target's decoder layers (``LayerStack``: q and kv fused into one
    qkv); its outputs over rounds of extend and draft are the op-by-op path's within the dtype's
    rounding (in bfloat16 its norms take bfloat16 weights), and it drafts the same tokens.
    Unserved, or served dense, it has no such call."""
    from kernels import native
    from kernels.int4 import Q4Weight

    assert native.library() is not None  # built by `make test` (tests/test_native_ops.py)
    spec, head, embed = _native_sized_head()
    rows = embed[head.output_ids].to(dtype)
    assert head._stack is None
    head.serve(dtype, int4=False)
    assert head._stack is None  # dense matrices: op by op
    assert head.serve(dtype, int4=True) == 6 and isinstance(head._served["q"], Q4Weight)
    stack, calls = head._stack, []
    assert stack is not None

    class Counting:  # the native layer, counting its calls
        def forward(self, *args):
            calls.append(args[0].shape[1])
            return stack.forward(*args)

    gen = torch.Generator().manual_seed(22)
    feats = torch.randn(40, 64, generator=gen).to(dtype)
    tokens = torch.randint(0, 30, (41,), generator=gen)
    embed16 = embed.to(dtype)

    def rounds(layer):
        head._stack = layer
        return _serve_rounds(head, spec, 1, feats, tokens, embed16, rows)

    native_out, native_drafts = rounds(Counting())
    assert calls == [17, 1, 1, 1, 1, 1, 5, 1, 1, 17, 1, 1]  # an extend and two drafting steps a round
    by_op, op_drafts = rounds(None)
    assert native_out.abs().max() > 0.5
    torch.testing.assert_close(native_out, by_op, rtol=tol, atol=tol)
    assert native_drafts == op_drafts


@NEEDS_Q4_NATIVE_F32
def test_a_head_served_with_16_bit_inputs_rounds_them_in_its_native_layer_as_op_by_op() -> None:
    """Served in float32 with ``bits`` 16 (what ``auto`` serves where the native kernel rounds
    float32 inputs: load_feature_draft), the head's native layer and its op-by-op path round the
    same inputs (each row's own blocks): the same outputs within float32's rounding and the same
    drafts; against the exact inputs the outputs move, by a little."""
    from kernels.int4 import q4_rounded_native

    if not q4_rounded_native(torch.float32, 16):
        pytest.skip("no native 16-bit activation path for float32 on this CPU (it needs AVX2)")
    spec, head, embed = _native_sized_head()
    rows = embed[head.output_ids]
    gen = torch.Generator().manual_seed(22)
    feats, tokens = torch.randn(40, 64, generator=gen), torch.randint(0, 30, (41,), generator=gen)

    def rounds(bits: int, native_layer: bool):
        head.serve(torch.float32, int4=True, bits=bits)
        if not native_layer:
            head._stack = None
        return _serve_rounds(head, spec, 1, feats, tokens, embed, rows)

    (native_out, native_drafts), (by_op, op_drafts) = rounds(16, True), rounds(16, False)
    exact, _ = rounds(0, True)
    torch.testing.assert_close(native_out, by_op, rtol=1e-4, atol=1e-4)
    assert native_drafts == op_drafts
    moved = (native_out - exact).abs().max()
    assert 0 < moved < 0.01 * exact.abs().max(), f"16-bit inputs moved the outputs by {moved}"
