"""An op-level harness for triedec's compiled kernels, as ggml's ``test-backend-ops``: one table
of ops (:data:`OPS`: the linear of each weight layout (int4, int5, int6 (Q6_K), Q4_K and Q5_K with their
mins, Q4_0, Q4_1 and Q5_1, int8 on 8-bit activations;
float32), tree attention, the RMS norms, rotary),
each with its shape generator, a float64 reference and an error bound, run on every installed
kernel library this CPU runs (:func:`check`: within the bound of the reference, and the same bits
on every library), and timed (:func:`perf`: each op's time, multiply-adds a second and bytes a
second, and its share of the machine's measured int8 dot-product peak and memory rate).

The references compute what each kernel's contract (``csrc/*.cpp``'s headers, docs/kernels.md)
says it computes, in float64: the 8-bit-activation linears on the quantized activations
(``x' a`` per group of 32) times the dequantized weights; the float32 linear, the norms, rotary
and attention on their inputs. The bounds are the contracts' roundings: one bf16 rounding of the
output (2^-8 relative) plus float32 sums over the features for the linears; a few float32 units
of the terms for the others.

    .venv/bin/python scripts/ops.py            # every op on every installed library
    .venv/bin/python scripts/ops.py --perf     # and the timings, with each op's share of the peak
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from triedec.model.linears import F32Linear
from triedec.model.native import load_kernel, switchable_libraries
from triedec.model.precision import (
    GROUP_SIZE,
    HALF_GROUP,
    SUPER_BLOCK,
    Int4A8Linear,
    Int5A8Linear,
    Int6A8Linear,
    Int8A8Linear,
    KQuantA8Linear,
    KQuantParts,
    ScaleMinA8Linear,
    ScaleMinParts,
    dequantize_int4,
)

Inputs = dict[str, Any]
EPS32 = 2.0**-24


@dataclass(frozen=True)
class Op:
    """One op of the table: ``build`` makes its inputs for a shape, ``run`` calls the kernel,
    ``reference`` computes the float64 result, ``bound`` the largest error allowed per element;
    ``macs`` and ``nbytes`` what it does and reads, for :func:`perf`; ``int8`` whether its dot
    products are 8-bit ones (its share is of the int8 peak, else of the memory rate only)."""

    name: str
    check_shapes: tuple[dict[str, int], ...]
    perf_shapes: tuple[dict[str, int], ...]
    build: Callable[[dict[str, int], torch.Generator], Inputs]
    run: Callable[[Any, Inputs], torch.Tensor]
    reference: Callable[[Inputs], torch.Tensor]
    bound: Callable[[Inputs, torch.Tensor], torch.Tensor]
    macs: Callable[[dict[str, int]], float]
    nbytes: Callable[[dict[str, int]], float]
    int8: bool = False


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The 8-bit-activation kernels' view of ``x [R, K]`` in float64: per group of 32,
    ``round(x * 127 / max|x|) * max|x| / 127`` (zero for a group below 1e-30)."""
    groups = x.float().reshape(x.shape[0], -1, GROUP_SIZE)
    top = groups.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(top > 1e-30, torch.tensor(127.0) / top, torch.zeros_like(top))
    q = torch.round(groups * inv).clamp(-127, 127)
    return (q.double() * (top.double() / 127)).reshape(x.shape)


def q5_0_weights(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Weights as a Q5_0 block holds them: per group of 32, an fp16 ``d`` of either sign times codes
    in -16..15, -16 among them."""
    codes = torch.randint(-16, 16, (n, k), generator=gen)
    codes.view(n, -1, GROUP_SIZE)[:, :, 0] = -16
    d = torch.rand(n, k // GROUP_SIZE, generator=gen) * 0.004 + 1e-3
    d = (d * torch.where(torch.rand(d.shape, generator=gen) < 0.5, -1.0, 1.0)).to(torch.float16).float()
    return codes.float() * d.repeat_interleave(GROUP_SIZE, dim=1)


def q6_k_weights(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Weights as a Q6_K block holds them, computed as the ``gguf`` package dequantizes one (float32
    ``(d * S) * q``): per super-block of 256 an fp16 ``d`` of either sign, per 16 an int8 ``S`` in
    -128..127 and codes ``q`` in -32..31."""
    codes = torch.randint(-32, 32, (n, k), generator=gen)
    subs = torch.randint(-128, 128, (n, k // HALF_GROUP), generator=gen)
    d = torch.rand(n, k // SUPER_BLOCK, generator=gen) * 4e-5 + 1e-5
    d = (d * torch.where(torch.rand(d.shape, generator=gen) < 0.5, -1.0, 1.0)).to(torch.float16).float()
    scale = d.repeat_interleave(SUPER_BLOCK // HALF_GROUP, dim=1) * subs.float()
    return scale.repeat_interleave(HALF_GROUP, dim=1) * codes.float()


def kquant_parts(bits: int, n: int, k: int, gen: torch.Generator) -> KQuantParts:
    """A Q4_K (``bits`` 4) or Q5_K (5) layer's blocks: any codes, scales and mins in 0..63, per
    super-block of 256 a positive fp16 ``d`` and ``dmin`` (as llama.cpp's quantizer makes them)."""
    def half(shape: tuple[int, int]) -> torch.Tensor:
        return (torch.rand(shape, generator=gen) * 4e-4 + 1e-4).to(torch.float16).float()

    def six_bits() -> torch.Tensor:
        return torch.randint(0, 64, (n, k // GROUP_SIZE), generator=gen).to(torch.uint8)

    codes = torch.randint(0, 2**bits, (n, k), generator=gen).to(torch.uint8)
    return KQuantParts(bits, codes, six_bits(), six_bits(), half((n, k // SUPER_BLOCK)), half((n, k // SUPER_BLOCK)))


def scale_min_parts(kind: str, n: int, k: int, gen: torch.Generator) -> ScaleMinParts:
    """A Q4_0, Q4_1 or Q5_1 layer's blocks: any codes, per group of 32 a positive fp16 ``d`` and an
    fp16 ``m`` of either sign (Q4_0: ``m = -8 d``), as llama.cpp's quantizer makes them."""
    codes = torch.randint(0, 32 if kind == "Q5_1" else 16, (n, k), generator=gen).to(torch.uint8)
    d = (torch.rand(n, k // GROUP_SIZE, generator=gen) * 4e-3 + 1e-3).to(torch.float16)
    m = d * -8 if kind == "Q4_0" else ((torch.rand(d.shape, generator=gen) - 0.7) * 0.1).to(torch.float16)
    return ScaleMinParts(kind, codes, d.float(), m.float())


def _a8_linear(kind: str) -> Op:
    layer_class = {"int4": Int4A8Linear, "int5": Int5A8Linear, "int6": Int6A8Linear, "int8": Int8A8Linear,
                   "q4_k": KQuantA8Linear, "q5_k": KQuantA8Linear, "q4_0": ScaleMinA8Linear,
                   "q4_1": ScaleMinA8Linear, "q5_1": ScaleMinA8Linear}[kind]

    def build(shape: dict[str, int], gen: torch.Generator) -> Inputs:
        linear = nn.Linear(shape["K"], shape["N"], bias=False)
        if kind in ("q4_k", "q5_k"):
            parts = kquant_parts(int(kind[1]), shape["N"], shape["K"], gen)
            layer = KQuantA8Linear(linear, parts)
            x = (torch.randn(shape["R"], shape["K"], generator=gen) * 2).to(torch.bfloat16)
            step = parts.d.repeat_interleave(8, dim=1) * parts.scales.float()
            low = parts.dmin.repeat_interleave(8, dim=1) * parts.mins.float()
            # the kernel sums d sc q and dmin m apart: its roundings scale with their magnitudes
            size = (step.repeat_interleave(GROUP_SIZE, dim=1) * parts.codes.float()
                    + low.repeat_interleave(GROUP_SIZE, dim=1))
            return {"layer": layer, "x": x, "weight": parts.values().double(), "magnitude": size.double()}
        if kind in ("q4_0", "q4_1", "q5_1"):
            sm = scale_min_parts(kind.upper(), shape["N"], shape["K"], gen)
            layer = ScaleMinA8Linear(linear, sm)
            x = (torch.randn(shape["R"], shape["K"], generator=gen) * 2).to(torch.bfloat16)
            # the kernel sums d q and m apart: its roundings scale with their magnitudes
            size = (sm.d.repeat_interleave(GROUP_SIZE, dim=1) * sm.codes.float()
                    + sm.m.abs().repeat_interleave(GROUP_SIZE, dim=1))
            return {"layer": layer, "x": x, "weight": sm.values().double(), "magnitude": size.double()}
        with torch.no_grad():
            if kind == "int5":
                linear.weight.copy_(q5_0_weights(shape["N"], shape["K"], gen))
            elif kind == "int6":
                linear.weight.copy_(q6_k_weights(shape["N"], shape["K"], gen))
            else:
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * 0.05)
        layer = layer_class(linear)
        x = (torch.randn(shape["R"], shape["K"], generator=gen) * 2).to(torch.bfloat16)
        weight = dequantize_int4(layer.codes(), *layer.scale_and_zero()) if kind == "int4" else layer.dequantized()
        return {"layer": layer, "x": x, "weight": weight.double()}

    def run(kernel: Any, inp: Inputs) -> torch.Tensor:
        layer = inp["layer"]
        if kind == "int4":
            return kernel.int4_linear(inp["x"], layer.packed, layer.scales_zeros, False)
        if kind == "int5":
            return kernel.int5_linear(inp["x"], layer.packed, layer.highs, layer.scales, False)
        if kind == "int6":
            return kernel.int6_linear(inp["x"], layer.packed, layer.highs, layer.scales, layer.supers, False)
        if kind in ("q4_k", "q5_k"):
            return kernel.kquant_linear(inp["x"], layer.packed, layer.highs, layer.scales_mins, layer.supers, False)
        if kind in ("q4_0", "q4_1", "q5_1"):
            return kernel.scale_min_linear(inp["x"], layer.packed, layer.highs, layer.dm, False)
        return kernel.int8_linear(inp["x"], layer.packed, layer.scales, False)

    def reference(inp: Inputs) -> torch.Tensor:
        return quantized_activations(inp["x"]) @ inp["weight"].T

    def bound(inp: Inputs, expected: torch.Tensor) -> torch.Tensor:
        terms = quantized_activations(inp["x"]).abs() @ inp.get("magnitude", inp["weight"]).abs().T
        groups = inp["x"].shape[1] // GROUP_SIZE
        return 2**-8 * expected.abs() + 4 * EPS32 * groups * terms + 1e-30

    bits = {"int4": 4.5, "int5": 5.5, "int6": 6.625, "int8": 8.5, "q4_k": 4.75, "q5_k": 5.75, "q4_0": 4.5,
            "q4_1": 5, "q5_1": 6}[kind]
    if kind in ("int6", "q4_k", "q5_k"):  # K-quants: rows of whole super-blocks (Qwen2.5 0.5B's ffn_down)
        checks = ({"R": 1, "K": 256, "N": 48}, {"R": 7, "K": 512, "N": 208}, {"R": 19, "K": 768, "N": 80})
        perfs = ({"R": 1, "K": 4864, "N": 896}, {"R": 16, "K": 4864, "N": 896}, {"R": 256, "K": 4864, "N": 896})
    else:
        checks = ({"R": 1, "K": 64, "N": 48}, {"R": 7, "K": 96, "N": 208}, {"R": 19, "K": 160, "N": 80})
        perfs = ({"R": 1, "K": 576, "N": 1536}, {"R": 16, "K": 576, "N": 1536}, {"R": 256, "K": 576, "N": 1536})
    return Op(f"linear {kind}-a8", checks, perfs,
              build, run, reference, bound, lambda s: s["R"] * s["K"] * s["N"],
              lambda s: s["K"] * s["N"] * bits / 8 + s["R"] * s["K"] * 2, int8=True)


def _f32_linear() -> Op:
    def build(shape: dict[str, int], gen: torch.Generator) -> Inputs:
        linear = nn.Linear(shape["K"], shape["N"])
        with torch.no_grad():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * 0.05)
            linear.bias.copy_(torch.randn(linear.bias.shape, generator=gen))
        return {"layer": F32Linear(linear), "x": torch.randn(shape["R"], shape["K"], generator=gen),
                "weight": linear.weight.detach().double(), "bias": linear.bias.detach().double()}

    def bound(inp: Inputs, expected: torch.Tensor) -> torch.Tensor:
        terms = inp["x"].double().abs() @ inp["weight"].abs().T + inp["bias"].abs()
        return (inp["x"].shape[1] + 2) * EPS32 * terms + 1e-30

    return Op("linear f32", ({"R": 1, "K": 64, "N": 48}, {"R": 9, "K": 96, "N": 208}),
              ({"R": 1, "K": 576, "N": 1536}, {"R": 16, "K": 576, "N": 1536}),
              build, lambda k, inp: k.f32_linear(inp["x"], inp["layer"].packed, inp["layer"].padded_bias),
              lambda inp: inp["x"].double() @ inp["weight"].T + inp["bias"], bound,
              lambda s: s["R"] * s["K"] * s["N"], lambda s: 4 * (s["K"] * s["N"] + s["R"] * s["K"]))


def _rms_norm(one_plus: bool) -> Op:
    def build(shape: dict[str, int], gen: torch.Generator) -> Inputs:
        return {"x": torch.randn(shape["R"], shape["D"], generator=gen) * 3,
                "w": torch.randn(shape["D"], generator=gen), "eps": 1e-6}

    def reference(inp: Inputs) -> torch.Tensor:
        x = inp["x"].double()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inp["eps"])
        return normed * ((1 + inp["w"].double()) if one_plus else inp["w"].double())

    def bound(inp: Inputs, expected: torch.Tensor) -> torch.Tensor:
        return (8 + inp["x"].shape[1] / 32) * EPS32 * expected.abs() + 1e-30

    return Op("rms_norm " + ("one-plus-weight" if one_plus else "weight"),
              ({"R": 1, "D": 64}, {"R": 300, "D": 64}, {"R": 5, "D": 576}), ({"R": 16, "D": 576}, {"R": 256, "D": 576}),
              build, lambda k, inp: k.rms_norm(inp["x"], inp["w"], inp["eps"], one_plus), reference, bound,
              lambda s: 2 * s["R"] * s["D"], lambda s: 8 * s["R"] * s["D"] + 4 * s["D"])


def _rotary() -> Op:
    def build(shape: dict[str, int], gen: torch.Generator) -> Inputs:
        positions = torch.arange(shape["N"], dtype=torch.float32)[:, None]
        freqs = positions / (10000.0 ** (torch.arange(0, shape["d"], 2, dtype=torch.float32) / shape["d"]))
        emb = torch.cat([freqs, freqs], dim=-1)
        return {"x": torch.randn(1, shape["H"], shape["N"], shape["d"], generator=gen),
                "cos": emb.cos()[None], "sin": emb.sin()[None]}

    def turned(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def reference(inp: Inputs) -> torch.Tensor:
        x, cos, sin = inp["x"].double(), inp["cos"].double()[:, None], inp["sin"].double()[:, None]
        return x * cos + turned(x) * sin

    def bound(inp: Inputs, expected: torch.Tensor) -> torch.Tensor:
        x, cos, sin = inp["x"].double(), inp["cos"].double()[:, None], inp["sin"].double()[:, None]
        return 3 * EPS32 * ((x * cos).abs() + (turned(x) * sin).abs()) + 1e-30

    return Op("rotary", ({"H": 2, "N": 5, "d": 16}, {"H": 9, "N": 33, "d": 64}), ({"H": 9, "N": 16, "d": 64},
                                                                                  {"H": 9, "N": 256, "d": 64}),
              build, lambda k, inp: k.rotary(inp["x"], inp["cos"], inp["sin"]), reference, bound,
              lambda s: 2 * s["H"] * s["N"] * s["d"], lambda s: 8 * s["H"] * s["N"] * s["d"] + 8 * s["N"] * s["d"])


def _tree_attention() -> Op:
    def build(shape: dict[str, int], gen: torch.Generator) -> Inputs:
        return {"q": torch.randn(shape["H"], shape["N"], shape["d"], generator=gen),
                "k": torch.randn(shape["H"], shape["L"], shape["d"], generator=gen),
                "v": torch.randn(shape["H"], shape["L"], shape["d"], generator=gen), "scale": shape["d"] ** -0.5}

    def reference(inp: Inputs) -> torch.Tensor:
        scores = inp["q"].double() @ inp["k"].double().transpose(-1, -2) * inp["scale"]
        return (torch.softmax(scores, dim=-1) @ inp["v"].double()).transpose(0, 1)  # [N, H, d], as the kernel

    def bound(inp: Inputs, expected: torch.Tensor) -> torch.Tensor:
        length, dim = inp["k"].shape[1], inp["q"].shape[-1]
        return 8 * (length + dim) * EPS32 * inp["v"].abs().amax() + 0 * expected

    return Op("tree_attention", ({"H": 2, "N": 1, "L": 7, "d": 16}, {"H": 4, "N": 9, "L": 40, "d": 32}),
              ({"H": 9, "N": 1, "L": 512, "d": 64}, {"H": 9, "N": 16, "L": 512, "d": 64}),
              build, lambda k, inp: k.tree_attention(inp["q"], inp["k"], inp["v"], None, None, inp["scale"], 0.0),
              reference, bound, lambda s: 2 * s["H"] * s["N"] * s["L"] * s["d"],
              lambda s: 4 * (2 * s["H"] * s["L"] * s["d"] + 2 * s["H"] * s["N"] * s["d"]))


OPS: tuple[Op, ...] = (_a8_linear("int4"), _a8_linear("int5"), _a8_linear("int6"), _a8_linear("q4_k"),
                       _a8_linear("q5_k"), _a8_linear("q4_0"), _a8_linear("q4_1"), _a8_linear("q5_1"),
                       _a8_linear("int8"),
                       _f32_linear(), _rms_norm(False), _rms_norm(True), _rotary(), _tree_attention())
"""The table: every op of triedec's kernel libraries a forward calls, by name."""


@dataclass(frozen=True)
class Checked:
    """One op and shape on one library: the largest error over its bound (<= 1 passes) and
    whether its bits equal the first library's."""

    op: str
    shape: dict[str, int]
    isa: str
    worst: float
    same_bits: bool

    @property
    def ok(self) -> bool:
        return self.worst <= 1.0 and self.same_bits


def _libraries(kernel: Any) -> dict[str, Any]:
    """The installed libraries this CPU runs (just the loaded one for a build made on first use)."""
    return switchable_libraries() or {kernel.isa(): None}


def check(seed: int = 0, ops: tuple[Op, ...] = OPS) -> list[Checked]:
    """Every op of ``ops`` on each of its check shapes, on every installed kernel library: the
    output against its float64 reference within its bound, and its bits against the first
    library's. The loaded library is restored afterwards."""
    kernel = load_kernel()
    libraries, loaded = _libraries(kernel), kernel.isa()
    results: list[Checked] = []
    try:
        for op in ops:
            for index, shape in enumerate(op.check_shapes):
                inputs = op.build(shape, torch.Generator().manual_seed(seed * 1000 + index))
                expected = op.reference(inputs)
                allowed = op.bound(inputs, expected)
                first = None
                for isa, path in libraries.items():
                    if path is not None:
                        kernel.use_kernels(str(path))
                    with torch.inference_mode():
                        got = op.run(kernel, inputs)
                    worst = float(((got.double() - expected).abs() / allowed).max())
                    same = first is None or torch.equal(first, got)
                    first = got if first is None else first
                    results.append(Checked(op.name, dict(shape), isa, worst, same))
    finally:
        if libraries.get(loaded) is not None:
            kernel.use_kernels(str(libraries[loaded]))
    return results


def int8_peak(kernel: Any, seconds: float = 0.2) -> float:
    """Multiply-adds a second of the loaded build's 8-bit dot-product loop (``dot_peak``: 12
    independent chains) on torch's threads."""
    iterations = 1000
    while True:
        start = time.perf_counter()
        done = kernel.dot_peak(iterations)
        took = time.perf_counter() - start
        if took >= seconds:
            return done / took
        iterations = int(iterations * max(2.0, seconds / max(took, 1e-6) * 1.2))


def memory_rate(kernel: Any, buffer: torch.Tensor) -> float:
    """Bytes a second at which ``stream_read`` reads ``buffer`` (uint8) once over the threads."""
    start = time.perf_counter()
    kernel.stream_read(buffer)
    return buffer.numel() / (time.perf_counter() - start)


@dataclass(frozen=True)
class Timed:
    """One op and shape on the loaded library: the median and the quartiles of its time, what it
    did a second, and its share of the measured int8 peak (8-bit ops) and of the memory rate."""

    op: str
    shape: dict[str, int]
    seconds: float
    quartiles: tuple[float, float]
    macs_per_second: float
    bytes_per_second: float
    peak_share: float | None
    memory_share: float


def perf(repeats: int = 30, trials: int = 5, stream_mib: int = 256, ops: tuple[Op, ...] = OPS
         ) -> tuple[float, float, list[Timed]]:
    """``(int8 peak, memory rate, timings)`` on the loaded library and torch's threads: the best
    of ``trials`` measurements of each limit, and each op's perf shapes timed ``repeats`` times
    after a warm-up call."""
    kernel = load_kernel()
    peak = max(int8_peak(kernel) for _ in range(trials))
    buffer = torch.ones(stream_mib << 20, dtype=torch.uint8)
    kernel.stream_read(buffer)  # the pages exist before the trials
    rate = max(memory_rate(kernel, buffer) for _ in range(trials))
    del buffer
    timed: list[Timed] = []
    for op in ops:
        for shape in op.perf_shapes:
            inputs = op.build(shape, torch.Generator().manual_seed(0))
            with torch.inference_mode():
                op.run(kernel, inputs)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    op.run(kernel, inputs)
                    times.append(time.perf_counter() - start)
            q1, median, q3 = statistics.quantiles(times, n=4)
            macs, nbytes = op.macs(shape) / median, op.nbytes(shape) / median
            timed.append(Timed(op.name, dict(shape), median, (q1, q3), macs, nbytes,
                               macs / peak if op.int8 else None, nbytes / rate))
    return peak, rate, timed
