"""gpt-fast's recipe for a compiled decode step, measured beside the served one (`bench step --compiled`).

The served target runs its layers as one native call (kernels/csrc/layer_stack.cpp, ``LayerStack``).
The other way to remove the ~20 small ops a layer dispatches is a compiler: a static KV cache whose
positions are tensors (the served cache keeps its bookkeeping in Python integers, which dynamo
guards on: it recompiled at every new position), the whole forward as one function of
(token ids, positions), and ``torch.compile`` of it for each number of positions (a shape bucket),
which inductor turns into fused C++/OpenMP loops on a CPU (CUDA graphs on a GPU).

``StaticDecoder`` is that forward for a Llama-family model, built from a loaded model's weights.
Its matrices: ``native``, our own 4-bit and 8-bit kernels (the served ones, registered as torch
custom ops so that inductor calls them as extern kernels and fuses everything between them);
``int4``, ATen's int4 kernel (``_weight_int4pack_mm_for_cpu``, the weight-only quantised matmul
torch ships for CPUs) with the output layer dense; or ``dense``, dequantized to the activations'
dtype. Norms, RoPE and residuals round as the served layers do. Attention over the whole static
cache in float32 with a mask: keys at positions <= each row's own.

What it does not do: serve. It exists to measure the lever (compile time, step and verify ms,
agreement with the served model); `bench step` reports it beside the native stack.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native
from kernels.int4 import GROUP, Q4Weight, q4_dense
from kernels.int8 import Q8Weight
from tools.bench.apart import run_apart

MATMULS = ("native", "int4", "dense")


@torch.library.custom_op("specstream_bench::q4_matmul", mutates_args=())
def _q4_matmul(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return native.library().q4_matmul(x.contiguous(), codes, d, m)  # [M, N] bfloat16


@_q4_matmul.register_fake
def _(x, codes, d, m):
    return x.new_empty(x.shape[0], d.shape[0] * d.shape[2])


@torch.library.custom_op("specstream_bench::q8_matmul", mutates_args=())
def _q8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return native.library().q8_matmul(x.contiguous(), codes, scale)  # [M, N] float32


@_q8_matmul.register_fake
def _(x, codes, scale):
    return x.new_empty(x.shape[0], codes.shape[0], dtype=torch.float32)


class StaticDecoder(nn.Module):
    """One sequence's forward over a static cache of ``max_len`` positions: (ids [n], positions [n])
    -> logits [n, V]. ``matmul``: one of ``MATMULS`` (the module docstring)."""

    def __init__(self, model, max_len: int, matmul: str = "native") -> None:
        super().__init__()
        if matmul not in MATMULS:
            raise ValueError(f"StaticDecoder: matmul {matmul!r} is not one of {MATMULS}")
        c = model.config
        plain = all(layer.qkv_b is None and layer.o_b is None and layer.gate_up_b is None and layer.down_b is None
                    and layer.act is F.silu and not layer.window for layer in model.layers)
        if not plain or c.output_vocab is not None:
            raise ValueError(f"StaticDecoder: {c.name} has biases, another activation than SiLU, a sliding "
                             "window or a reduced vocabulary: only the plain Llama layer is written here")
        self.dtype = model.dtype
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps = c.norm_eps
        self.scale = model.layers[0].scale
        self.embed = model.embed.detach()  # [V, H]
        self.vocab = c.vocab_size
        self.norm = model.norm.detach()  # [H]
        head = model.lm_head if model.lm_head is not None else model.embed
        self.head = ("q8", model.head_q8.codes, model.head_q8.scale) if matmul == "native" and isinstance(
            model.head_q8, Q8Weight) else self._matrix(head, matmul)  # [V, H]
        model._prepare_positions(max_len)
        self.cos, self.sin = model.rope_cos[:max_len], model.rope_sin[:max_len]  # [S, D]
        self.layers = []
        for layer in model.layers:
            mats = [self._matrix(w, matmul) for w in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w)]
            self.layers.append((layer.input_norm.detach(), layer.post_norm.detach(), *mats))
        L = len(self.layers)
        self.register_buffer("k", torch.zeros(L, c.num_kv_heads, max_len, c.head_dim, dtype=self.dtype))  # [L, Hkv, S, D]
        self.register_buffer("v", torch.zeros_like(self.k))  # [L, Hkv, S, D]
        self.key_positions = torch.arange(max_len)  # [S]

    def _matrix(self, weight, matmul: str):
        if not isinstance(weight, Q4Weight):
            return ("dense", weight.detach())
        parts = weight.parts() if weight.native else None
        if parts is None:
            raise ValueError("StaticDecoder: a 4-bit matrix in ATen's layout cannot be read back")
        if matmul == "dense":
            return ("dense", q4_dense(*parts, torch.bfloat16).to(self.dtype))  # [N, K]
        if matmul == "native":
            return ("q4", weight.packed, weight.d, weight.m)
        aten = Q4Weight.from_parts(*parts, self.dtype, use_native=False)
        return ("int4", aten.packed, aten.scale_zero)

    @staticmethod
    def _linear(x: torch.Tensor, matrix) -> torch.Tensor:
        if matrix[0] == "dense":
            return x @ matrix[1].t()
        if matrix[0] == "q4":
            return _q4_matmul(x, *matrix[1:])
        if matrix[0] == "q8":
            return _q8_matmul(x, *matrix[1:])
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, matrix[1], GROUP, matrix[2])

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(self.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        D, Hq, Hkv = self.head_dim, self.heads, self.kv_heads
        x = self.embed[ids]  # [n, H]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [n, 1, D]
        mask = self.key_positions[None, :] <= positions[:, None]  # [n, S]
        for layer, (in_w, post_w, qkv_w, o_w, gate_up_w, down_w) in enumerate(self.layers):
            qkv = self._linear(self._rms(x, in_w), qkv_w)  # [n, (Hq + 2 Hkv) D]
            q, k, v = qkv.split((Hq * D, Hkv * D, Hkv * D), dim=-1)
            q = self._rope(q.view(n, Hq, D), cos, sin).transpose(0, 1)  # [Hq, n, D]
            k = self._rope(k.view(n, Hkv, D), cos, sin).transpose(0, 1)  # [Hkv, n, D]
            self.k[layer].index_copy_(1, positions, k)
            self.v[layer].index_copy_(1, positions, v.view(n, Hkv, D).transpose(0, 1))
            groups = q.float().reshape(Hkv, Hq // Hkv * n, D)  # [Hkv, G n, D]: a key head's query heads together
            scores = (groups @ self.k[layer].float().transpose(1, 2)).view(Hq, n, -1) * self.scale  # [Hq, n, S]
            weights = scores.masked_fill(~mask, float("-inf")).softmax(-1).view(Hkv, Hq // Hkv * n, -1)
            attn = (weights @ self.v[layer].float()).view(Hq, n, D).to(self.dtype)  # [Hq, n, D]
            x = x + self._linear(attn.transpose(0, 1).reshape(n, Hq * D), o_w)  # [n, H]
            gate, up = self._linear(self._rms(x, post_w), gate_up_w).chunk(2, dim=-1)  # [n, I] each
            x = x + self._linear(F.silu(gate) * up, down_w)  # [n, H]
        return self._linear(self._rms(x, self.norm), self.head).float()  # [n, V]


@torch.inference_mode()
def compiled_curve(model, context: int, positions: tuple[int, ...], repeats: int = 20,
                   matmul: str = "native") -> dict:
    """Compile ``StaticDecoder`` of ``model`` for each bucket of ``positions`` (timing each compile),
    then the median ms of a forward over n new positions after ``context`` cached ones, compiled
    and eager, buckets taking turns; and the compiled forward's logits against the served model's
    over the same positions (max |difference|, same greedy tokens)."""
    decoder = StaticDecoder(model, context + max(positions) + 1, matmul)
    compiled = torch.compile(decoder, fullgraph=True, dynamic=False)
    prefix = torch.tensor([1 + i % min(50, decoder.vocab - 1) for i in range(context)])  # [context]
    served_cache = model.new_cache(1, context + max(positions) + 1)
    slot = torch.tensor([served_cache.alloc()])
    model(prefix[None], served_cache, slot, torch.tensor([0]))
    decoder(prefix, torch.arange(context))
    ids = {n: torch.tensor([(100 + 7 * i) % decoder.vocab for i in range(n)]) for n in positions}  # [n]
    at = {n: torch.arange(context, context + n) for n in positions}  # [n]
    compile_s = {}
    for n in positions:
        begin = time.perf_counter()
        compiled(ids[n], at[n])
        compile_s[n] = time.perf_counter() - begin
    times: dict[str, dict[int, list[float]]] = {"compiled": {n: [] for n in positions},
                                                "eager": {n: [] for n in positions}}
    for i in range(repeats + 2):
        for n in positions:
            for name, run in (("compiled", compiled), ("eager", decoder)):
                begin = time.perf_counter()
                run(ids[n], at[n])
                if i >= 2:
                    times[name][n].append((time.perf_counter() - begin) * 1000)
    agreement = {}
    for n in positions:
        served = model(ids[n][None], served_cache, slot, torch.tensor([context]))[0].float()  # [n, V]
        served_cache.set_length(int(slot), context)
        got = compiled(ids[n], at[n])  # [n, V]
        agreement[n] = {"max_abs": (got - served).abs().max().item(),
                        "same_greedy": bool(torch.equal(got.argmax(-1), served.argmax(-1)))}
    return {"matmul": matmul, "compile_s": compile_s,
            **{name: {n: statistics.median(t) for n, t in by_n.items()} for name, by_n in times.items()},
            "agreement": agreement}


def compiled_curve_apart(target: Path, dtype: str, weights: str, context: int, positions: tuple[int, ...],
                         matmul: str = "native") -> dict:
    """``compiled_curve`` of the model at ``target`` in a process of its own (tools.bench.apart):
    inductor's compile threads would slow this process's torch thread afterwards."""
    out = run_apart(_compiled_curve_of, target=str(target), dtype=dtype, weights=weights, context=context,
                    positions=list(positions), matmul=matmul)
    for key in ("compile_s", "compiled", "eager", "agreement"):
        out[key] = {int(n): v for n, v in out[key].items()}
    return out


def _compiled_curve_of(target: str, dtype: str, weights: str, context: int, positions: list[int],
                       matmul: str) -> dict:
    from specstream.models.loader import load_model

    model = load_model(target, dtype=dtype, weights=weights)
    return compiled_curve(model, context, tuple(positions), matmul=matmul)
