"""The C++ CPU expert kernel against float64, for every weight format and every ISA level this CPU runs."""

import contextlib
import copy

import pytest
import torch

import torch_hybrid_moe as thm
from torch_hybrid_moe.embedded import load_model
from torch_hybrid_moe.ops import cpu_kernel
from torch_hybrid_moe.ops.expert_math import accumulate_experts_
from torch_hybrid_moe.ops.quantize import (
    QuantizedWeight,
    dequantize,
    lay_out,
    lay_out_experts_,
    quantize,
    quantize_activations,
)
from torch_hybrid_moe.runtime import expert_store, model_layers

from .conftest import float64_experts as reference

pytestmark = pytest.mark.usefixtures("kernel")

FORMATS = ["float32", "bfloat16", "float16", "int8", "int4"]


def experts(fmt, num_experts, hidden, inter, seed=0, group=32):
    """(kernel operands, the float64 weights they stand for)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(num_experts, hidden, inter, generator=g) * 0.1
    if fmt in ("int8", "int4"):
        q = [quantize(w, 8 if fmt == "int8" else 4, group) for w in (gate_up, down)]
        ref = [torch.stack([w[e] for e in range(num_experts)]).double() for w in q]
        return (q[0].data, q[1].data, q[0].scale, q[1].scale), ref
    gate_up, down = gate_up.to(getattr(torch, fmt)), down.to(getattr(torch, fmt))
    return (gate_up, down, None, None), [gate_up.double(), down.double()]


def run(operands, hidden, ids, weights, isa=None, route=None):
    gate_up, down, gate_up_scale, down_scale = operands
    out = torch.zeros(hidden.shape)
    cpu_kernel.moe_experts(hidden, ids, weights, gate_up, down, out, gate_up_scale, down_scale, isa=isa, route=route)
    return out


def routing(tokens, num_experts, top_k, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    return ids, torch.rand(ids.shape, generator=g)


GEMM_ROUTES = {  # 70 tokens x top-4 of 8 experts: every expert over the threshold of the GEMM routes
    "micro_kernels": cpu_kernel.MICRO_KERNELS,
    "fp32_panels": cpu_kernel.GemmRoute(32, "fp32"),
    "bf16_gemm": cpu_kernel.GemmRoute(32, "bf16"),
    "amx": cpu_kernel.GemmRoute(32, "amx"),
}


def check_against_float64(fmt, operands, weights64, tokens, isa=None, route=None, bf16_hidden=False):
    gate_up, down = weights64
    hidden = torch.randn(tokens, gate_up.shape[2], generator=torch.Generator().manual_seed(tokens))
    if bf16_hidden:
        hidden = hidden.bfloat16()
    ids, weights = routing(tokens, gate_up.shape[0], 4)
    rounded, bf16_h = fmt in ("int8", "int4"), fmt == "bfloat16" and bf16_hidden
    ref = reference(hidden, ids, weights, gate_up, down, rounded, bf16_h)
    out = run(operands, hidden, ids, weights, isa, route)
    atol = 1e-5 * ref.abs().max().item()
    if rounded or bf16_h:  # an fp32 h on a rounding boundary may take the neighbouring int8 or bf16 step in the
        # float64 reference: allow one such step (its size times the largest down weight); the integer products
        # themselves are checked exactly in test_dense_linear.py
        gate, up = torch.einsum("enh,th->etn", gate_up, hidden.double()).chunk(2, dim=-1)
        step = (torch.nn.functional.silu(gate) * up).abs().amax() / (127 if rounded else 128)
        atol += step.item() * down.abs().max().item()
    bf16_gemm = route is not None and route.kernel != "fp32" and fmt in ("bfloat16", "int8", "int4")
    if bf16_gemm:  # inputs, gate / up and h rounded to bf16 as transformers' bf16 experts round them
        atol, rtol = 2e-2 * ref.abs().max().item(), 2e-2
    else:
        rtol = 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)
    if bf16_h and not bf16_gemm:  # the step allowed above exceeds what rounding h moves: h is rounded, not kept in
        # fp32 or truncated
        unrounded = reference(hidden, ids, weights, gate_up, down)
        assert (out.double() - ref).abs().mean() < 0.1 * (out.double() - unrounded).abs().mean()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 5])
def test_formats_match_float64(fmt, isa, tokens):
    operands, weights64 = experts(fmt, 8, 64, 96)
    check_against_float64(fmt, operands, weights64, tokens, isa)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("route", GEMM_ROUTES)
@pytest.mark.parametrize("bf16_hidden", [False, True])
def test_gemm_routes_match_float64(fmt, route, bf16_hidden):
    """Prefill: every route on every format (the bf16 GEMMs to bf16, int8 and int4 weights; fp32 and fp16 weights
    fall to fp32 panels, bf16 would round them)."""
    if route == "amx" and not cpu_kernel.amx_fits(64, 96):
        pytest.skip("no AMX on this CPU")
    operands, weights64 = experts(fmt, 8, 64, 96)
    check_against_float64(fmt, operands, weights64, 70, route=GEMM_ROUTES[route], bf16_hidden=bf16_hidden)


def laid_out(operands):
    """int4 kernel operands with every expert laid out for the AVX-512 lanes (ops/quantize.py `lay_out`)."""
    gate_up, down, gate_up_scale, down_scale = operands
    (gate_up, gate_up_scale), (down, down_scale) = lay_out(gate_up, gate_up_scale), lay_out(down, down_scale)
    return gate_up, down, gate_up_scale, down_scale


@pytest.mark.parametrize("route", ["micro_kernels", "fp32_panels", "bf16_gemm"])
@pytest.mark.parametrize("tokens", [1, 3, 6, 70])
@pytest.mark.parametrize("group", [32, 64])
def test_laid_out_int4_experts_match_float64(route, tokens, group):
    """int4 experts laid out for the lanes, 16 rows a panel (as CPU-only stores hold them where measured faster): one
    to six tokens (one to four a pass over a panel, experts with one or two tokens), and at 70 the GEMM routes, which
    gather the rows back; 192 intermediate rows split between the threads in whole panels."""
    if cpu_kernel.best_isa() < 2:
        pytest.skip("laid-out int4 rows need the AVX-512 VNNI kernels")
    if route != "micro_kernels" and tokens < 70:
        pytest.skip("the GEMM routes start at 32 tokens an expert")
    operands, weights64 = experts("int4", 8, 128, 192, group=group)
    check_against_float64("int4", laid_out(operands), weights64, tokens, route=GEMM_ROUTES[route])


def test_laid_out_experts_are_refused_where_the_kernel_cannot_read_them():
    if cpu_kernel.best_isa() < 2:
        pytest.skip("laid-out int4 rows need the AVX-512 VNNI kernels")
    operands, _ = experts("int4", 4, 128, 64)
    gate_up, down, gus, dns = laid_out(operands)
    hidden, (ids, weights) = torch.randn(2, 128), routing(2, 4, 2)
    with pytest.raises(RuntimeError, match="laid-out int4 experts need ISA level 2"):
        cpu_kernel.moe_experts(hidden, ids, weights, gate_up, down, torch.zeros(2, 128), gus, dns, isa=1)
    with pytest.raises(RuntimeError, match="both be laid out for the lanes, or neither"):
        cpu_kernel.moe_experts(hidden, ids, weights, gate_up, operands[1], torch.zeros(2, 128), gus, operands[3])
    with pytest.raises(RuntimeError, match=r"scales must be contiguous CPU fp16 \[E, N / 16, K / group, 16\]"):
        cpu_kernel.moe_experts(hidden, ids, weights, gate_up, down, torch.zeros(2, 128), operands[2], dns)
    with pytest.raises(RuntimeError, match="laid-out experts must be int4"):
        cpu_kernel.moe_experts(hidden, ids, weights, gate_up.view(torch.int8), down, torch.zeros(2, 128), gus, dns)


def test_experts_laid_out_in_place_read_as_the_rows_they_were():
    """`lay_out_experts_`: expert by expert into the same memory, each expert as `lay_out` lays it out alone; `rows`
    and indexing give back the rows and the dequantised weights; bad input refused with nothing changed."""
    q = quantize(torch.randn(3, 48, 128, generator=torch.Generator().manual_seed(0)), 4, 64)
    data, scale, dequantised = q.data.clone(), q.scale.clone(), [q[e] for e in range(3)]
    laid = lay_out_experts_(q)
    assert laid.laid and laid.shape == (3, 48, 128) and laid.data.data_ptr() == q.data.data_ptr()
    for e in range(3):
        assert all(torch.equal(a, b) for a, b in zip((laid.data[e], laid.scale[e]), lay_out(data[e], scale[e])))
        assert torch.equal(laid[e], dequantised[e])
    assert all(torch.equal(a, b) for a, b in zip(laid.rows(slice(1, 3)), (data[1:], scale[1:])))
    assert all(torch.equal(a, b) for a, b in zip(laid.rows(torch.tensor([2, 0])), (data[[2, 0]], scale[[2, 0]])))
    for bad in (quantize(torch.randn(2, 40, 128), 4, 32), quantize(torch.randn(2, 48, 128), 8, 32), laid):
        before = bad.data.clone()
        with pytest.raises(ValueError, match="lay_out_experts_ takes int4 rows"):
            lay_out_experts_(bad)
        assert torch.equal(bad.data, before)


@pytest.mark.parametrize("route", ["micro_kernels", "amx"])
def test_silu_at_saturating_gates_matches_float64(route):
    """Gate values of thousands, where e^-g is 0 or overflows in fp32: the kernel's vectorised silu(g) * u still
    matches float64 on the micro-kernels and on the AMX tiles."""
    if route == "amx" and not cpu_kernel.amx_fits(64, 96):
        pytest.skip("no AMX on this CPU")
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(8, 2 * 96, 64, generator=g) * 0.1
    gate_up[:, :96] *= 1e4
    down = torch.randn(8, 64, 96, generator=g) * 0.1
    gate_up, down = gate_up.bfloat16(), down.bfloat16()
    hidden = torch.randn(40, 64, generator=g)
    ids, weights = routing(40, 8, 4)
    ref = reference(hidden, ids, weights, gate_up.double(), down.double())
    out = run((gate_up, down, None, None), hidden, ids, weights, route=GEMM_ROUTES[route])
    assert out.isfinite().all()
    tol = 1e-5 if route == "micro_kernels" else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_amx_route_over_column_chunks_and_token_blocks(fmt):
    """The AMX tiles where the token blocks pass the panel chunk by chunk: 320 / 288 columns (10 / 9 blocks of 32, two
    chunks each) and 40-60 tokens an expert (3-4 blocks of 16, the last one partial), against float64."""
    if not cpu_kernel.amx_fits(320, 288):
        pytest.skip("no AMX on this CPU")
    operands, (gate_up, down) = experts(fmt, 8, 320, 288)
    hidden = torch.randn(100, 320, generator=torch.Generator().manual_seed(3)).bfloat16()
    ids, weights = routing(100, 8, 4)
    ref = reference(hidden, ids, weights, gate_up, down, fmt != "bfloat16")
    out = run(operands, hidden, ids, weights, route=cpu_kernel.GemmRoute(16, "amx"))
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_amx_route_refuses_what_it_cannot_run():
    """A GEMM kernel the C++ side does not know, or the AMX tiles on experts whose sizes are not multiples of 32 (or
    on a CPU without AMX), is a clear error, never a silent other route."""
    operands, _ = experts("bfloat16", 4, 40, 24)
    hidden = torch.randn(40, 40, dtype=torch.bfloat16)
    ids, weights = routing(40, 4, 2)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        run(operands, hidden, ids, weights, route=cpu_kernel.GemmRoute(16, "amx"))
    with pytest.raises(ValueError, match="unknown GEMM kernel"):
        cpu_kernel.GemmRoute(16, "fast")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("group", [32, 64, 96])
def test_quantised_group_sizes_and_steps_with_tails(fmt, isa, group):
    """384 columns: whole vector steps only (AVX-512: 6 int8 steps of 2 blocks, 3 int4 steps of 4); 192: steps plus
    a tail (int4: one step and 2 blocks); groups of 1, 2 and 3 blocks, which a step's lanes straddle unevenly."""
    operands, weights64 = experts(fmt, 8, 384, 192, group=group)
    check_against_float64(fmt, operands, weights64, 3, isa)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("group", [32, 96])
@pytest.mark.parametrize("tokens", [1, 3])
def test_quantised_odd_block_counts(fmt, isa, group, tokens):
    """288 and 96 columns: 9 and 3 blocks, so int4's pairs of blocks end on an unpaired block, and with groups of 3
    blocks a pair straddles two groups."""
    operands, weights64 = experts(fmt, 8, 288, 96, group=group)
    check_against_float64(fmt, operands, weights64, tokens, isa)


@contextlib.contextmanager
def lanes_from(tokens, level):
    """Every format's lanes at `level` from `tokens` tokens a call on, for the block (this machine's measured starts
    before and after)."""
    ext = cpu_kernel.extension()
    formats = cpu_kernel.LANE_FORMATS.get(level, ())
    before = {f: ext.get_lane_start(level, f) for f in formats}
    try:
        for f in formats:
            ext.set_lane_start(level, f, tokens)
        yield
    finally:
        for f, start in before.items():
            ext.set_lane_start(level, f, start)


def check_rows_at_many_tokens(x, weight, scale, dense, isa, reference):
    """dense_matvec of 9-42 tokens (lane runs of 4 or 8 and tails of every length) against float64: the weight
    `dense` times `reference(x)` (the activations as the kernel rounds them); and a token's output the same bits in
    any batch of 16 tokens or more, at any thread count. The lanes start at 8 tokens at the AVX-512 level and 16 at
    the AVX2 level here (the kernel's starts until measured). (Below the lanes' start the per-row loop sums in another
    order: another batch size may round a token's output differently there, as the GEMM routes do.)"""
    with lanes_from({1: 16, 2: 8}.get(isa, cpu_kernel.UNLIMITED), isa):
        check_pinned_rows_at_many_tokens(x, weight, scale, dense, isa, reference)


def check_pinned_rows_at_many_tokens(x, weight, scale, dense, isa, reference):
    outs = {n: cpu_kernel.dense_matvec(x[:n], weight, scale, isa) for n in (9, 12, 14, 15, 16, 18, 19, 21, 42)}
    for n, out in outs.items():
        want = reference(x[:n]).double() @ dense.T
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert all(torch.equal(outs[n], outs[42][:n]) for n in (16, 18, 19, 21))
    assert torch.equal(cpu_kernel.dense_matvec(x[19:42], weight, scale, isa), outs[42][19:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernel.dense_matvec(x, weight, scale, isa), outs[42])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group, columns", [(32, 384), (64, 384), (96, 384), (128, 384), (64, 8192)])
def test_quantised_rows_at_many_tokens_match_float64_and_keep_each_token_alone(isa, bits, group, columns):
    """Rows go through lanes (rows_kernel.h, lane_route) from 16 tokens a call on at the AVX2 level (eight int4 rows
    at a time), from 8 on at the AVX-512 level (sixteen int8 or int4 rows); below, and at the portable level, the
    per-row loops run. 100 rows (a short last group of 8 and of 16); 384 columns (6 steps, groups straddling them at
    96) or 8192 (several panels and token chunks)."""
    g = torch.Generator().manual_seed(group + columns + bits)
    q = quantize(torch.randn(1, 100, columns, generator=g).mul(0.1), bits, group)
    x = torch.randn(42, columns, generator=g)
    check_rows_at_many_tokens(x, q.data[0], q.scale[0], q[0].double(), isa, quantize_activations)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("columns", [384, 2048, 8192])
def test_bf16_rows_at_many_tokens_match_float64_and_keep_each_token_alone(isa, columns, dtype):
    """bf16 rows times bf16 activations go through lanes from 8 tokens a call on at the AVX-512 level on CPUs with
    AVX512-BF16 (32 rows at a time); fp32 activations, and other levels, take the per-row loop. 600 rows, in runs of
    76 (2 threads) or 152 (1 thread): full groups of 32 and a short last one; 384 columns (one panel holds a run's
    rows), 2048 (panels of 32 rows, each next one prefetched) or 8192 (a group larger than a panel, several token
    chunks). Neither rounds the activations."""
    g = torch.Generator().manual_seed(columns)
    weight = torch.randn(600, columns, generator=g).mul(0.1).bfloat16()
    x = torch.randn(42, columns, generator=g).to(dtype)
    check_rows_at_many_tokens(x, weight, None, weight.double(), isa, lambda x: x)


def test_lane_start_is_where_the_lanes_win_from_on():
    counts = (8, 16, 32, 64)
    assert cpu_kernel.lane_start_from(counts, [2, 3, 4, 5], [1, 2, 3, 4]) == 8  # faster everywhere
    assert cpu_kernel.lane_start_from(counts, [2, 3, 4, 5], [3, 2, 3, 4]) == 16
    assert cpu_kernel.lane_start_from(counts, [2, 3, 4, 5], [1, 4, 3, 4]) == 32  # a win below a loss is no start
    assert cpu_kernel.lane_start_from(counts, [2, 3, 4, 5], [1, 2, 3, 5]) == cpu_kernel.UNLIMITED  # a tie: no lanes


def test_lane_starts_are_measured_set_and_checked(kernel):
    """The starts measured at this CPU's best level are the kernel's; a level, format or count it has no lane route
    for is refused."""
    level = cpu_kernel.best_isa()
    starts = cpu_kernel.lane_starts()
    assert set(starts) <= set(cpu_kernel.LANE_FORMATS.get(level, ()))
    assert all(n in (*cpu_kernel.LANE_TOKENS, cpu_kernel.UNLIMITED) for n in starts.values())
    assert all(kernel.get_lane_start(level, f) == n for f, n in starts.items())
    with pytest.raises(RuntimeError, match="ISA levels 1 and 2, not 3"):
        kernel.set_lane_start(3, "int4", 8)
    with pytest.raises(RuntimeError, match="no lane route for fp16 at ISA level 2"):
        kernel.set_lane_start(2, "fp16", 8)
    with pytest.raises(RuntimeError, match="no lane route for int8 at ISA level 1"):
        kernel.get_lane_start(1, "int8")
    with pytest.raises(RuntimeError, match="token count >= 1, got 0"):
        kernel.set_lane_start(1, "int4", 0)
    assert kernel.get_lane_start(1, "int4") in (*cpu_kernel.LANE_TOKENS, cpu_kernel.UNLIMITED)  # nothing changed


def test_measured_route_is_one_of_the_routes():
    operands, weights64 = experts("bfloat16", 8, 64, 96)
    route = cpu_kernel.gemm_route(torch.zeros(70, 64, dtype=torch.bfloat16), operands[0], None)
    counts = cpu_kernel.ROUTE_TOKENS
    assert route == cpu_kernel.MICRO_KERNELS or counts[0] <= route.tokens <= counts[-1]
    assert cpu_kernel.gemm_route(torch.zeros(15, 64), operands[0], None) == cpu_kernel.MICRO_KERNELS  # decode


def test_route_of_experts_whose_group_does_not_divide_the_timed_width(kernel):
    """int8 experts 576 wide in groups of 96 (valid for the model): the route is timed on 480 of those columns, a
    whole number of groups, where 512 could not be quantised and the first prompt of 16 tokens failed."""
    operands, weights64 = experts("int8", 4, 192, 576, group=96)
    route = cpu_kernel.gemm_route(torch.zeros(16, 192), operands[0], operands[2])
    assert route == cpu_kernel.MICRO_KERNELS or route.tokens >= cpu_kernel.ROUTE_TOKENS[0]
    check_against_float64("int8", operands, weights64, 16, route=route)


@pytest.mark.parametrize("inter, kernels", [(512, ["fp32", "bf16", "amx"]), (520, ["fp32", "bf16"])])
def test_amx_is_timed_only_for_widths_it_runs(inter, kernels, tmp_path, monkeypatch):
    """bf16 experts wider than the timed stand-in (512 columns) are timed on 512: AMX is a candidate only where the
    model's own width is a multiple of 32. It was asked of the stand-in, so a 520-wide model could be routed to AMX
    and every prompt refused. An AMX CPU is simulated and the timings scripted (the last candidate wins)."""
    timed: list[int] = []

    def timings(runs, repeats):
        timed.append(len(runs) - 1)  # GEMM candidates beside the micro-kernels
        return [float(len(runs) - i) for i in range(len(runs))]

    monkeypatch.setattr(cpu_kernel, "amx_fits", lambda h, i: h % 32 == 0 and i % 32 == 0)
    monkeypatch.setattr(cpu_kernel, "interleaved_medians", timings)
    monkeypatch.setattr(cpu_kernel, "_cold_experts", lambda h, i, s, group, g: ([None] * 4, 1))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a routes file of its own
    route = cpu_kernel._measure_route.__wrapped__(64, inter, torch.bfloat16, 0, torch.bfloat16, 1, (16, 32))
    assert timed == [len(kernels)] * 2 and route.kernel == kernels[-1]


@pytest.mark.parametrize(
    "margins, kernel, tokens",
    [
        ([-1, -1, -1, -1, -1, -1], "amx", 16),  # wins from the first count on
        ([1, -1, -1, -1, -1, -1], "amx", 24),  # crosses half-way from 16 to 32
        ([3, -1, -1, -1, -1, -1], "amx", 28),  # three quarters of the way
        ([-1, 1, 1, -1, -1, -1], "amx", 96),  # a loss at 32 and 64 overrides the win at 16
        ([1, 1, 1, 1, 1, -1], "amx", 384),  # wins only at the largest count: from half-way there
        ([-1, -1, -1, -1, -1, 1], None, None),  # loses at the largest count: micro-kernels throughout
    ],
)
def test_route_starts_where_the_measured_times_cross(margins, kernel, tokens):
    """The start count is the linear crossing of the GEMM's and the micro-kernels' times, each count measured: a
    route that starts at a measured count half a factor-2 step early or late costs a tenth of a layer's time."""
    micro = [float(n) for n in cpu_kernel.ROUTE_TOKENS]
    gemm = [[m + 2.0, m + d] for m, d in zip(micro, margins, strict=True)]  # "bf16" always loses to "amx"
    route = cpu_kernel._crossover(cpu_kernel.ROUTE_TOKENS, micro, gemm, ["bf16", "amx"])
    assert route == (cpu_kernel.MICRO_KERNELS if kernel is None else cpu_kernel.GemmRoute(tokens, kernel))


@pytest.mark.parametrize("hidden_size, inter", [(40, 24), (7, 5), (100, 33)])
def test_column_counts_not_multiple_of_the_vector_step(isa, hidden_size, inter):
    operands, (gate_up, down) = experts("bfloat16", 4, hidden_size, inter)
    hidden = torch.randn(6, hidden_size)
    ids, weights = routing(6, 4, 2)
    out = run(operands, hidden, ids, weights, isa)
    torch.testing.assert_close(out.double(), reference(hidden, ids, weights, gate_up, down), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["unused_expert", "one_token", "all_on_one_expert", "all_skipped", "top_k_equals_e"])
def test_routing_edge_cases(case):
    operands, (gate_up, down) = experts("bfloat16", 6, 64, 32)
    tokens = {"one_token": 1, "all_on_one_expert": 40}.get(case, 9)
    hidden = torch.randn(tokens, 64)
    ids, weights = routing(tokens, 6, 6 if case == "top_k_equals_e" else 2)
    if case == "unused_expert":
        ids[ids == 5] = 4
    if case == "all_on_one_expert":
        ids = torch.full((tokens, 1), 3)
        weights = weights[:, :1]
    if case == "all_skipped":
        ids[:] = -1
    out = run(operands, hidden, ids, weights)
    torch.testing.assert_close(out.double(), reference(hidden, ids, weights, gate_up, down), rtol=1e-5, atol=1e-6)
    if case == "all_skipped":
        assert not out.any()


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_thread_count_and_batch_do_not_change_results(fmt):
    """Each dot product is one thread's full-row sum in a fixed order: bitwise equal across thread counts,
    and a token's output does not depend on the other tokens of its batch (decode route)."""
    operands, _ = experts(fmt, 16, 128, 64)
    hidden = torch.randn(8, 128)
    ids, weights = routing(8, 16, 4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(operands, hidden, ids, weights)
        torch.set_num_threads(2)
        two = run(operands, hidden, ids, weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    alone = run(operands, hidden[3:4], ids[3:4], weights[3:4])
    assert torch.equal(alone[0], two[3])


def test_quantisation_error_is_half_a_step_and_int4_packs_pairs():
    w = torch.randn(2, 3, 64)
    for bits, qmax in ((8, 127), (4, 7)):
        q = quantize(w, bits, 32)
        step = q.scale.repeat_interleave(32, dim=-1)
        back = dequantize(q.data, q.scale, bits, 32)
        assert (back - w).abs().le(step / 2 + 1e-6).all()
        exact = w.unflatten(-1, (2, 32)).abs().amax(-1) / qmax
        assert q.scale.dtype == torch.float16 and (q.scale.float() >= exact).all()  # rounded up: no |q| past qmax
        assert (torch.nextafter(q.scale, torch.full_like(q.scale, -torch.inf)).float() < exact).all()  # the next fp16
    q4 = quantize(w, 4, 32)
    codes = torch.round(w / q4.scale.repeat_interleave(32, dim=-1)).clamp(-8, 7) + 8
    assert torch.equal(q4.data & 15, codes[..., 0::2].to(torch.uint8))  # column 2j: low nibble of byte j
    assert torch.equal(q4.data >> 4, codes[..., 1::2].to(torch.uint8))


@pytest.mark.parametrize("bits", [8, 4])
def test_fp16_scales_keep_tiny_groups_and_refuse_weights_they_cannot_hold(bits):
    """Groups whose scale is below fp16's normal range (subnormal, or below its smallest value, or all zero) come back
    within half their step; weights whose scale fp16 cannot hold are refused, not turned into inf."""
    w = torch.zeros(1, 4, 64)
    w[0, 0, :32] = 1e-9
    w[0, 1] = torch.linspace(-1e-5, 1e-5, 64)
    w[0, 2] = torch.linspace(-3.0, 3.0, 64)
    q = quantize(w, bits, 32)
    back = dequantize(q.data, q.scale, bits, 32)
    assert (back - w).abs().le(q.scale.float().repeat_interleave(32, dim=-1) / 2).all()
    assert (q.scale > 0).all() and torch.equal(back[0, 3], w[0, 3])
    with pytest.raises(ValueError, match="fp16 group scales hold at most"):
        quantize(torch.full((1, 1, 32), 1e7), bits, 32)


@pytest.mark.parametrize("fmt", ["float32", "int8", "int4"])
def test_torch_fallback_matches_float64(fmt):
    """`accumulate_experts_` (the torch fallback, the accelerator's uncaptured share and other tests' reference)
    against the per-pair float64 loop; int8 / int4 round each projection's input as the kernel does."""
    operands, weights64 = experts(fmt, 8, 64, 96)
    hidden = torch.randn(7, 64)
    ids, weights = routing(7, 8, 3)
    ids[2, 1] = -1  # a pair computed elsewhere
    gate_up, down, gus, dns = operands
    if gus is not None:
        gate_up = QuantizedWeight.from_kernel_operands(gate_up, gus)
        down = QuantizedWeight.from_kernel_operands(down, dns)
    got = accumulate_experts_(torch.zeros(7, 64, dtype=torch.float64), hidden, ids, weights, gate_up, down)
    want = reference(hidden, ids, weights, *weights64, rounded=fmt != "float32")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_torch_fallback_agrees_with_kernel_on_quantised_weights():
    operands, _ = experts("int4", 8, 64, 96)
    hidden = torch.randn(5, 64)
    ids, weights = routing(5, 8, 3)
    gate_up, down, gus, dns = operands
    fallback = torch.zeros(5, 64)
    accumulate_experts_(
        fallback,
        hidden,
        ids,
        weights,
        QuantizedWeight.from_kernel_operands(gate_up, gus),
        QuantizedWeight.from_kernel_operands(down, dns),
    )
    torch.testing.assert_close(run(operands, hidden, ids, weights), fallback, rtol=1e-5, atol=1e-6)


def test_kernel_rejects_bad_operands():
    operands, _ = experts("int8", 4, 64, 32)
    gate_up, down, gus, dns = operands
    hidden = torch.randn(2, 64)
    ids, weights = routing(2, 4, 2)
    with pytest.raises(RuntimeError, match="multiple of 32"):  # 64 columns in 4 groups of 16
        cpu_kernel.moe_experts(hidden, ids, weights, gate_up, down, torch.zeros(2, 64), gus.repeat(1, 1, 2), dns)
    with pytest.raises(RuntimeError, match="need scales"):
        cpu_kernel.moe_experts(hidden, ids, weights, gate_up, down, torch.zeros(2, 64))
    with pytest.raises(RuntimeError, match="scales must be contiguous CPU fp16"):  # fp32: an older store's scales
        cpu_kernel.moe_experts(hidden, ids, weights, gate_up, down, torch.zeros(2, 64), gus.float(), dns)
    with pytest.raises(ValueError, match="ISA level"):
        cpu_kernel.moe_experts(hidden, ids, weights, gate_up, down, torch.zeros(2, 64), gus, dns, isa=3)
    # Empty hidden or intermediate sizes: clear errors where a division by zero once killed the process (SIGFPE).
    with pytest.raises(RuntimeError, match="hidden size >= 1"):
        empty = torch.zeros(2, 0)
        cpu_kernel.moe_experts(empty, ids, weights, torch.zeros(4, 8, 0), torch.zeros(4, 0, 4), empty)
    with pytest.raises(RuntimeError, match="I >= 1"):
        cpu_kernel.moe_experts(hidden, ids, weights, torch.zeros(4, 0, 64), torch.zeros(4, 64, 0), torch.zeros(2, 64))


@pytest.mark.parametrize(
    "fmt, name, laid",
    [("int8", "deepseek-tiny", False), ("int4", "deepseek-tiny", False), ("int4", "mixtral-tiny", True)],
)
def test_quantised_model_equals_the_model_with_dequantised_experts(fmt, name, laid, monkeypatch):
    """Patched with cpu_weight_dtype=int8/int4, the model is the unpatched one whose expert weights are the
    dequantised ones and whose expert projections take inputs rounded per 32 columns, wherever each expert runs
    (budget 0: all on the CPU kernel; 0.5: slots too). `laid`: the CPU-only store's int4 experts laid out for the
    lanes (as where measured faster; mixtral-tiny's widths allow it, deepseek-tiny's 32 do not)."""
    if laid and cpu_kernel.best_isa() < 2:
        pytest.skip("laid-out int4 rows need the AVX-512 VNNI kernels")
    monkeypatch.setattr(expert_store, "laid_out_wins", lambda data, scale: laid)
    model, _ = load_model(name, dtype=torch.float32)
    reference = copy.deepcopy(model)
    reference.set_experts_implementation("eager")  # the per-expert loop of F.linear calls
    bits = 8 if fmt == "int8" else 4
    expert_weights = set()
    for layer in reference.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(experts, name)
                q = quantize(w, bits, 64)
                w.data.copy_(dequantize(q.data, q.scale, bits, q.group_size))
                expert_weights.add(w)
    linear = torch.nn.functional.linear

    def rounding_linear(x, weight, bias=None):  # transformers' experts multiply slices weight[e] of their parameters
        return linear(quantize_activations(x) if weight._base in expert_weights else x, weight, bias)

    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with monkeypatch.context() as m:
            m.setattr(torch.nn.functional, "linear", rounding_linear)
            want = reference(ids).logits
        for budget in (0.0, 0.5):
            patched = thm.patch_model(copy.deepcopy(model), expert_budget=budget, device="cpu", cpu_weight_dtype=fmt)
            stores = [layer.store for layer in model_layers(patched).values()]
            hosts = [w for store in stores for w in (store.host_gate_up, store.host_down)]
            assert all(w.laid == (laid and budget == 0) for w in hosts)  # slot fills read rows: never laid out
            torch.testing.assert_close(patched(ids).logits, want, rtol=1e-4, atol=1e-4)


def test_quantised_patch_with_unfit_group_is_a_clear_error_and_leaves_the_model_alone():
    model, _ = load_model("deepseek-tiny", dtype=torch.float32)  # moe_intermediate_size 32
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="multiple of 32"):
        thm.patch_model(model, cpu_weight_dtype="int8", cpu_weight_group_size=96)
    assert not thm.model_patches.base.is_patched(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize(
    "field, value", [("cpu_weight_dtype", "int3"), ("cpu_weight_group_size", 48), ("cpu_weight_group_size", 0)]
)
def test_config_rejects_unknown_cpu_formats(field, value):
    with pytest.raises(ValueError, match=field):
        thm.HybridMoEConfig(**{field: value})


@pytest.mark.parametrize("bits", [8, 4])
def test_quantising_in_row_chunks_changes_nothing(bits, monkeypatch):
    """Large dense weights are quantised a chunk of rows at a time: bit for bit what one pass gives."""
    from torch_hybrid_moe.ops import quantize as quantize_module

    w = torch.randn(2, 7, 64)
    whole = quantize(w, bits, 32)
    monkeypatch.setattr(quantize_module, "QUANTIZE_ELEMENTS", 3 * 64)  # 3 rows a block
    chunked = quantize(w, bits, 32)
    assert torch.equal(whole.data, chunked.data) and torch.equal(whole.scale, chunked.scale)
