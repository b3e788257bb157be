"""`hybrid_moe::linear` (CPU bf16 / fp16 linears on the decode micro-kernels) against float64, and the backend
pass that routes a model's linears to it where measured faster."""

import copy

import pytest
import torch
import torch.nn.functional as F

from torch_hybrid_moe.compile_passes import dense_linear as dense_pass
from torch_hybrid_moe.ops import cpu_kernel, dense_linear
from torch_hybrid_moe.ops.quantize import BITS, dequantize, lay_out, quantize, quantize_activations, row_major
from torch_hybrid_moe.tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("kernel")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, "int8", "int4"])
@pytest.mark.parametrize(
    "n, k, tokens, group",
    [
        (37, 64, 1, 32),
        (130, 2048, 3, 32),
        (64, 100, 5, 32),
        (9, 256, 4, 64),
        (600, 2048, 40, 128),  # several row panels and token chunks with partial last ones; groups of two steps
        (70, 2304, 33, 96),  # a group of three blocks: steps straddle groups
        (50, 2080, 5, 32),  # an odd block count: an unpaired last block
        (21, 192, 1, 64),  # int4 at AVX-512: a step, then a last pair as a half step
        (13, 480, 3, 96),  # ... a half step whose two blocks fall in one group of three
        (11, 224, 2, 32),  # ... a half step, then an unpaired block
    ],
)
def test_dense_matvec_against_float64(dtype, isa, n, k, tokens, group):
    """Float weights times x; int8 / int4 (groups of 32, 64 and 96 columns) times x rounded per 32 columns, with the
    integer products summed exactly: both within fp32 summation error of float64."""
    if isinstance(dtype, str) and k % group:
        pytest.skip("quantised weights need whole groups")
    g = torch.Generator().manual_seed(n * k + tokens)
    w = torch.randn(n, k, generator=g) * 0.1
    x = torch.randn(tokens, k, generator=g)
    if isinstance(dtype, str):
        q = quantize(w.unsqueeze(0), BITS[dtype], group)
        got = cpu_kernel.dense_matvec(x, q.data[0], q.scale[0], isa=isa)
        want = quantize_activations(x).double() @ q[0].double().T
    else:
        w, x = w.to(dtype), x.to(dtype)
        got = cpu_kernel.dense_matvec(x, w, isa=isa)
        want = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (tokens, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k**0.5)


needs_lanes = pytest.mark.skipif(cpu_kernel.best_isa() < 2, reason="laid-out int4 rows need the AVX-512 VNNI kernels")


@needs_lanes
@pytest.mark.parametrize(
    ("n", "k", "tokens", "group"),
    [
        (16, 64, 1, 32),  # one panel, one step of 64 columns
        (48, 192, 3, 64),  # K % 128 == 64: the activations' last pair of blocks is a half step
        (160, 2048, 1, 32),  # panels split between the threads' runs
        (32, 2816, 5, 128),  # groups of four blocks
        (64, 960, 2, 96),  # groups of three blocks
    ],
)
def test_laid_out_int4_rows_against_float64(n, k, tokens, group):
    """int4 rows laid out for the AVX-512 lanes (`lay_out`) give the float64 product of the dequantised rows and the
    activations as the kernel rounds them, within fp32 summation error; `row_major` undoes the layout; the many-row
    route gathers laid-out rows into the same GEMM panels (bit for bit); laid-out and row-by-row siblings share a
    call, each giving what it gives alone."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(tokens, k, generator=g)
    q = quantize(torch.randn(1, n, k, generator=g) * 0.1, 4, group)
    laid, laid_scale = lay_out(q.data[0], q.scale[0])
    assert laid.shape == (n // 16, k // 8, 64) and laid_scale.shape == (n // 16, k // group, 16)
    assert all(torch.equal(a, b) for a, b in zip(row_major(laid, laid_scale), (q.data[0], q.scale[0])))
    got = cpu_kernel.dense_matvec(x, laid, laid_scale, isa=2)
    want = quantize_activations(x).double() @ q[0].double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k**0.5)
    rows = torch.randn(40, k, generator=g).to(torch.bfloat16)
    assert torch.equal(
        cpu_kernel.dense_gemm(rows, laid, laid_scale, None), cpu_kernel.dense_gemm(rows, q.data[0], q.scale[0], None)
    )
    xb = x.to(torch.bfloat16)
    both = torch.ops.hybrid_moe.matvecs(xb, [laid, q.data[0]], [laid_scale, q.scale[0]], [None, None])
    assert torch.equal(both[:, :n], torch.ops.hybrid_moe.matvecs(xb, [laid], [laid_scale], [None]))
    assert torch.equal(both[:, n:], torch.ops.hybrid_moe.matvecs(xb, [q.data[0]], [q.scale[0]], [None]))


def test_lay_out_refuses_rows_it_cannot_lay_out():
    for rows, columns in ((20, 64), (16, 96)):  # 16 rows a panel, 64 columns a step
        q = quantize(torch.randn(1, rows, columns), 4, 32)
        with pytest.raises(ValueError, match="N and K multiples of 16 and 64"):
            lay_out(q.data[0], q.scale[0])


@needs_lanes
def test_matvecs_refuses_a_malformed_laid_out_weight():
    q = quantize(torch.randn(1, 32, 128), 4, 32)
    laid, scale = lay_out(q.data[0], q.scale[0])
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"laid-out int4 weight must be a CPU uint8 tensor \[N / 16, K / 8, 64\]"):
        torch.ops.hybrid_moe.matvecs(x, [laid.view(2, 32, 32)], [scale], [None])
    with pytest.raises(RuntimeError, match=r"needs fp16 scales \[N / 16, K / group, 16\]"):
        torch.ops.hybrid_moe.matvecs(x, [laid], [scale.float()], [None])
    with pytest.raises(RuntimeError, match="laid-out int4 weights need ISA level 2"):
        cpu_kernel.dense_matvec(x.float(), laid, scale, isa=1)


@needs_lanes
@pytest.mark.parametrize("wins", [False, True])
def test_quantized_linear_lays_out_int4_rows_where_measured_faster(wins, monkeypatch):
    """An int4 QuantizedLinear holds its rows laid out exactly where that measured faster, computes the same product
    either way (decode rows on the micro-kernels, prefill rows on the GEMM route), and `hold_row_major` gives back
    the rows it quantised."""
    monkeypatch.setattr(dense_linear, "laid_out_wins", lambda data, scale: wins)
    linear = torch.nn.Linear(256, 48, bias=True).to(torch.bfloat16)
    layer = dense_linear.QuantizedLinear(linear, "int4", 32)
    assert (layer.qweight.dim() == 3) == wins and ("laid out" in repr(layer)) == wins
    q = quantize(linear.weight.detach().unsqueeze(0), 4, 32)
    for tokens in (1, 300):  # 300: past any measured kernel limit (QUANTIZED_COUNTS), the GEMM route
        x = torch.randn(tokens, 256).to(torch.bfloat16)
        want = quantize_activations(x).double() @ q[0].double().T + linear.bias.double()
        with torch.no_grad():
            torch.testing.assert_close(layer(x).double(), want, rtol=2**-7, atol=1e-2)
    layer.hold_row_major()
    assert torch.equal(layer.qweight, q.data[0]) and torch.equal(layer.scale, q.scale[0])


def _identity(k: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 / packed int4 (stored q + 8, column 2j in byte j's low nibble) [k, k] identity, scales 1."""
    if fmt == "int8":
        data = torch.eye(k, dtype=torch.int8)
    else:
        data = torch.full((k, k // 2), 0x88, dtype=torch.uint8)
        rows = torch.arange(k)
        data[rows, rows // 2] = torch.where(rows % 2 == 0, 0x89, 0x98).to(torch.uint8)
    return data, torch.ones(k, k // 32, dtype=torch.float16)


@pytest.mark.parametrize("k", [64, 2080])
def test_activations_are_rounded_bit_for_bit_as_quantize_activations(isa, k):
    """An identity times x is x as the kernels round it, each output one product (the other columns add zeros): the
    micro-kernels' records (int8 identity, each ISA level) and the GEMM route's rounded rows (int8 and int4 layouts,
    written over the rows in place; this CPU's best level) equal quantize_activations' values exactly, ties, zero and
    tiny blocks and signs included. (int4 records hold the int8 records' values in another order: the tolerance tests
    check that order.)"""
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(k)) * 4
    x[0, :32] = 0  # a zero block: scale 0, every value 0
    x[1, 32:64] = torch.arange(-16, 16) + 0.5  # with -127 at its max, a scale of 1: every value a tie, rounded to even
    x[1, 32] = -127
    x[2, :32] = 1e-38  # 1 / scale overflows: zeros, on every level and in the reference
    want = quantize_activations(x)
    assert not want[2, :32].any()
    got = cpu_kernel.dense_matvec(x, *_identity(k, "int8"), isa=isa)
    assert torch.equal(got, want)
    for fmt in ("int8", "int4"):
        assert torch.equal(cpu_kernel.dense_gemm(x, *_identity(k, fmt), None), want)


@pytest.mark.parametrize("tokens, limit", [(1, 4), (4, 4), (9, 4), (2, 0)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_op_rounds_once_like_torch(tokens, limit, bias):
    """Up to `limit` rows through the kernel, above it F.linear; both round once to bf16 from fp32 sums."""
    g = torch.Generator().manual_seed(tokens)
    w = (torch.randn(48, 96, generator=g) * 0.1).to(torch.bfloat16)
    b = (torch.randn(48, generator=g) * 0.1).to(torch.bfloat16) if bias else None
    x = torch.randn(1, tokens, 96, generator=g).to(torch.bfloat16)
    got = torch.ops.hybrid_moe.linear(x, w, None, b, limit)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (1, tokens, 48)
    torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=1e-3)  # one bf16 rounding
    torch.library.opcheck(torch.ops.hybrid_moe.linear.default, (x, w, None, b, limit))


def test_token_limit_is_measured_and_cached():
    w = torch.empty(256, 512, dtype=torch.bfloat16)
    limit = dense_linear.kernel_token_limit(w)
    assert limit in (0, *dense_linear.TOKEN_COUNTS)
    assert dense_linear.kernel_token_limit(torch.zeros_like(w)) == limit  # per shape and dtype, not per tensor


@pytest.mark.parametrize("limit, dynamic", [(0, False), (4, False), (4, True)])
def test_backend_routes_bf16_linears_and_keeps_the_output(limit, dynamic, monkeypatch):
    """A bf16 model compiled with the backend: each linear runs through the op exactly where the measurement
    said so (a graph of 3 tokens only: the kernel's `matvecs`; any token count: `linear`, which picks per call),
    and the logits stay the eager model's within bf16 rounding."""
    import torch_hybrid_moe  # noqa: F401  (registers the backend and ops)

    monkeypatch.setattr(dense_linear, "kernel_token_limit", lambda weight: limit)
    model = tiny_model("qwen3_moe").to(torch.bfloat16)
    seen, targets = [], []
    original = dense_pass.route_dense_linears

    def routed(gm, inputs):
        seen.append(original(gm, inputs))
        targets.extend(str(n.target) for n in gm.graph.nodes if "hybrid_moe." in str(n.target))
        return seen[-1]

    monkeypatch.setattr("torch_hybrid_moe.compile_passes.backend.route_dense_linears", routed)
    x = torch.randint(3, 96, (1, 3))
    with torch.no_grad():
        want = model(x).logits.double()
        got = torch.compile(model, backend="hybrid_moe", fullgraph=True, dynamic=dynamic)(x).logits.double()
        exact = tiny_model("qwen3_moe")(x).logits.double()
    # every nn.Linear, and the MoE routers' F.linear on their gate weight
    linears = sum(isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("Router") for m in model.modules())
    assert seen and set(seen) == {linears if limit else 0}  # per graph compiled
    op = "hybrid_moe.linear.default" if dynamic else "hybrid_moe.matvecs.default"
    assert sum(t == op for t in targets) == (linears if limit else 0) * len(seen)
    ours, theirs = (got - exact).abs().max().item(), (want - exact).abs().max().item()
    assert ours <= 2 * theirs, (ours, theirs)  # bf16 rounding, as transformers' own (0.005 against 0.003 here)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 3, 100])
def test_quantized_linear_computes_its_dequantised_weight(fmt, tokens):
    """Decode rows on the micro-kernels, prefill rows on the dequantised copy: both the float64 product of the
    weight the quantised form stands for and the activations rounded per 32 columns, rounded once."""
    g = torch.Generator().manual_seed(tokens)
    base = torch.nn.Linear(128, 40, bias=True)
    with torch.no_grad():
        base.weight.copy_(torch.randn(40, 128, generator=g) * 0.1)
    q = dense_linear.QuantizedLinear(base, fmt, 32)
    w = dequantize(q.qweight, q.scale, BITS[fmt], 32).double()
    x = torch.randn(2, tokens, 128, generator=g)
    want = quantize_activations(x).double() @ w.T + base.bias.double()
    torch.testing.assert_close(q(x).double(), want, rtol=1e-5, atol=1e-5)
    for limit in (0, cpu_kernel.UNLIMITED):  # both routes, whichever this machine measured faster
        q.max_tokens = limit
        torch.testing.assert_close(q(x).double(), want, rtol=1e-5, atol=1e-5)
    assert (w - base.weight.double()).abs().max() <= (0.02 if fmt == "int8" else 0.2)  # it is approximate


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_row_route_in_cpp_against_float64_and_torch(fmt, dtype, monkeypatch):
    """The many-row route of a quantised linear in C++ (activations rounded as the micro-kernels round them, the weight
    dequantised a panel of rows at a time, torch's fp32 GEMM): several panels, an odd count of 32-column blocks (int4
    pairs them), 3-D input, bias, strided operands; within one rounding to x's dtype of float64, and of torch's own
    form of the route (the two sum the columns in different orders, so a bf16 output may differ by one step)."""
    g = torch.Generator().manual_seed(7)
    n, k = 300, 96  # past one 256-row panel; three 32-column blocks
    q = quantize((torch.randn(n, k, generator=g) * 0.1).unsqueeze(0), BITS[fmt], 32)
    qw = type(q)(q.data[0], q.scale[0], q.bits, q.group_size)
    bias = torch.randn(n, generator=g)
    x = torch.randn(2, 70, k, generator=g).to(dtype)
    want = quantize_activations(x).double() @ dequantize(qw.data, qw.scale, qw.bits, 32).double().T + bias.double()
    got = cpu_kernel.dense_gemm(x, qw.data, qw.scale, bias)
    assert got.dtype == dtype and got.shape == (2, 70, n)
    one_rounding = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-8, atol=2**-8)
    torch.testing.assert_close(got.double(), want, **one_rounding)
    # operands that are views into larger tensors: the same product, not the bytes beside them
    strided = cpu_kernel.dense_gemm(
        x,
        torch.cat([qw.data, qw.data], 1)[:, : qw.data.shape[1]],
        torch.cat([qw.scale, qw.scale], 1)[:, : qw.scale.shape[1]],
        bias,
    )
    assert torch.equal(strided, got)
    assert torch.equal(dense_linear.dequantized_linear(x, qw, bias), got)  # the route takes the kernel where built
    monkeypatch.setattr(dense_linear.cpu_kernel, "best_isa", lambda: -1)  # torch's form, as without a compiler
    either_order = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(dense_linear.dequantized_linear(x, qw, bias).double(), got.double(), **either_order)


def test_many_row_route_refuses_bad_operands():
    """A float weight, scales of the wrong rank, or a bias of the wrong length is refused with a message, not
    multiplied."""
    q = quantize(torch.randn(1, 8, 64), 8, 32)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="int8 or packed int4"):
        cpu_kernel.dense_gemm(x, torch.randn(8, 64), q.scale[0], None)
    with pytest.raises(RuntimeError, match=r"scales \[N, K / group\]"):
        cpu_kernel.dense_gemm(x, q.data[0], q.scale, None)
    with pytest.raises(RuntimeError, match="bias must be a CPU tensor"):
        cpu_kernel.dense_gemm(x, q.data[0], q.scale[0], torch.zeros(5))


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_decode_route_refuses_quantized_weights_without_columns(dtype):
    """An int8 / int4 weight of no columns has a group size of 0, which the kernels would divide by: refused."""
    weight = torch.zeros(4, 0, dtype=dtype)
    with pytest.raises(RuntimeError, match="positive multiple of 32"):
        torch.ops.hybrid_moe.matvecs(torch.zeros(1, 0), [weight], [torch.ones(4, 1, dtype=torch.float16)], [None])


@pytest.mark.parametrize("rows", [0, 4])
def test_matvecs_refuses_float_weights_without_columns(rows):
    """x and bf16 weights of no columns (with rows or none): refused with an error, not a division by zero."""
    with pytest.raises(RuntimeError, match="no columns"):
        torch.ops.hybrid_moe.matvecs(
            torch.zeros(1, 0, dtype=torch.bfloat16), [torch.zeros(rows, 0, dtype=torch.bfloat16)], [None], [None]
        )


def test_quantized_linear_without_the_kernel_takes_the_dequantised_route(monkeypatch):
    """No compiler on the machine: the micro-kernels are missing, and decode rows must not reach them."""
    base = torch.nn.Linear(64, 8, bias=False)
    monkeypatch.setattr(dense_linear.cpu_kernel, "best_isa", lambda: -1)
    q = dense_linear.QuantizedLinear(base, "int8", 32)
    assert q.max_tokens == 0
    x = torch.randn(1, 64)
    want = quantize_activations(x).double() @ dequantize(q.qweight, q.scale, 8, 32).double().T
    torch.testing.assert_close(q(x).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kernel_wins, limit",
    [
        ((False,), dense_linear.TOKEN_COUNTS[-1]),  # lost at the first count: decode-sized batches only
        ((True, False), 128),  # won at 128 and lost at 256: a 128-token prefill stays on the micro-kernels
        ((True, True, False), 256),
        ((True,) * len(dense_linear.QUANTIZED_COUNTS), cpu_kernel.UNLIMITED),
    ],
)
@pytest.mark.parametrize("laid", [False, True])
def test_quantized_limit_is_the_last_count_won_in_a_row(kernel_wins, limit, laid, tmp_path, monkeypatch):
    """The micro-kernels keep every row count up to the largest compared count they won, with all smaller ones won
    too; each count is compared with the two routes' outputs on the same rows (scripted timings: the rule, not this
    host's noise, is under test), the weight row by row or laid out."""
    if laid and cpu_kernel.best_isa() < 2:
        pytest.skip("laid-out int4 weights need the AVX-512 VNNI kernels")
    compared: list[int] = []

    def timings(runs, repeats):
        outputs = [run() for run in runs]  # both routes really run: same rows, same values to bf16's rounding
        torch.testing.assert_close(outputs[0], outputs[1])
        compared.append(outputs[0].shape[0])
        return (1.0, 2.0) if kernel_wins[len(compared) - 1] else (2.0, 1.0)

    monkeypatch.setattr(dense_linear.cpu_kernel, "interleaved_medians", timings)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a routes file of its own, empty
    measure = dense_linear._measure_quantized.__wrapped__  # past this process's cache
    assert measure((64, 128), 4, 64, 1, 1, dense_linear.QUANTIZED_COUNTS, laid) == limit
    assert compared == list(dense_linear.QUANTIZED_COUNTS[: len(kernel_wins)])


def test_patch_quantises_dense_layers_on_request_and_refuses_to_save_them(tmp_path):
    import torch_hybrid_moe as thm

    ref = tiny_model("qwen3_moe")  # attention, a dense MLP layer and the LM head: all nn.Linear
    x = torch.randint(3, 96, (1, 6))
    model = thm.patch_model(copy.deepcopy(ref), dense_weight_dtype="int8", cpu_weight_group_size=32)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    quantised = [m for m in model.modules() if isinstance(m, dense_linear.QuantizedLinear)]
    assert len(quantised) == sum(type(m) is torch.nn.Linear for m in ref.modules())
    with torch.no_grad():
        got, want = model(x).logits, ref(x).logits
    assert 0 < (got - want).abs().max() < 0.05 * want.abs().max()  # approximate, and close
    with pytest.raises(RuntimeError, match="dense_weight_dtype='int8' quantised this linear"):
        model.save_pretrained(tmp_path)
    assert not list(tmp_path.iterdir())


def test_dense_quantisation_with_a_group_that_does_not_fit_changes_nothing():
    import torch_hybrid_moe as thm
    from torch_hybrid_moe.model_patches import is_patched

    model = tiny_model("qwen2_moe")  # its shared expert's down_proj has 40 inputs: no multiple of 32 divides them
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="dense_weight_dtype='int4': linear 'down_proj' \\(40 inputs\\)") as err:
        thm.patch_model(model, dense_weight_dtype="int4")
    assert "keep dense_weight_dtype='model'" in str(err.value)  # the option that was given, not the experts' one
    assert not is_patched(model) and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="dense_weight_dtype must be one of"):
        thm.HybridMoEConfig(dense_weight_dtype="fp8")


@pytest.mark.parametrize("upcast", [False, True])
def test_prefill_rows_take_the_measured_gemm_route(upcast, monkeypatch):
    """Above the kernel's rows, torch's GEMM in bf16 or (measured faster) in fp32: both the float64 product
    within one bf16 rounding."""
    monkeypatch.setattr(dense_linear, "upcast_wins", lambda weight: upcast)
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(64, 256, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(200, 256, generator=g).to(torch.bfloat16)
    got = torch.ops.hybrid_moe.linear(x, w, None, None, 4)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=2**-7, atol=1e-3)


def test_patched_bf16_model_routes_its_linears_and_saves_unchanged(tmp_path):
    """On the CPU, patching a bf16 model puts RoutedLinear in place of its nn.Linear layers: same parameters (ties
    kept, state dict and saved file unchanged), each the float64 product within bf16 rounding on either route."""
    from transformers import AutoModelForCausalLM

    import torch_hybrid_moe as thm
    from torch_hybrid_moe.embedded import load_model

    ref = load_model("deepseek-tiny", torch.bfloat16)[0]
    model = thm.patch_model(copy.deepcopy(ref), expert_budget=0.0, device="cpu")
    routed = [m for m in model.modules() if isinstance(m, dense_linear.RoutedLinear)]
    assert len(routed) == sum(type(m) is torch.nn.Linear for m in ref.modules()) and routed
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.state_dict().keys() == ref.state_dict().keys()
    for layer in routed:  # decode rows (micro-kernels where measured faster) and prefill rows (GEMM)
        for rows in (1, 80):
            x = torch.randn(rows, layer.in_features).to(torch.bfloat16)
            with torch.no_grad():
                got = layer(x).double()
            want = torch.nn.functional.linear(
                x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double()
            )
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2e-2)  # bf16 products, rounded once or per GEMM
    x = torch.randint(3, 500, (1, 80))
    with torch.no_grad():
        got, want = model(x).logits.double(), ref(x).logits.double()
    # bf16 roundings in other orders, position by position: a router's near-tie may pick another expert somewhere
    err = (got - want).abs().amax(-1) / want.abs().max()
    assert err.median() <= 2**-6 and (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    model.save_pretrained(tmp_path)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in ref.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, "int8", "int4"])
def test_matvecs_of_siblings_equal_each_linear_alone(dtype):
    """One `hybrid_moe::matvecs` call over several weights (with and without biases) gives each weight's own
    product side by side: the same fp32 sum rounded once to x's dtype, bit for bit; against float64 within that
    rounding."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 128, generator=g).to(torch.bfloat16 if isinstance(dtype, str) else dtype)
    weights, scales, biases, wanted = [], [], [], []
    for n, bias in ((64, False), (8, True), (130, False)):
        w = torch.randn(n, 128, generator=g) * 0.1
        b = torch.randn(n, generator=g).to(x.dtype) if bias else None
        if isinstance(dtype, str):
            q = quantize(w.unsqueeze(0), BITS[dtype], 64)
            w, s, dense = q.data[0], q.scale[0], q[0].double()
            xs = quantize_activations(x.reshape(-1, 128)).double()
        else:
            w, s = w.to(dtype), None
            dense, xs = w.double(), x.reshape(-1, 128).double()
        weights.append(w), scales.append(s), biases.append(b)
        wanted.append((xs @ dense.T + (0 if b is None else b.double())).reshape(2, 3, n))
    out = torch.ops.hybrid_moe.matvecs(x, weights, scales, biases)
    assert out.shape == (2, 3, sum(w.shape[0] for w in weights))
    for w, s, b, got, want in zip(weights, scales, biases, out.split([w.shape[0] for w in weights], -1), wanted):
        alone = torch.ops.hybrid_moe.matvecs(x, [w], [s], [b])
        assert got.dtype == x.dtype and torch.equal(got, alone)
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-3)
    torch.library.opcheck(torch.ops.hybrid_moe.matvecs.default, (x, weights, scales, biases))


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, "int4"])
def test_matvecs_runs_cover_every_row_at_any_thread_count(dtype, tokens):
    """At decode rows are handed out in runs that shrink towards the end (guided): with tens of thousands of short
    rows across siblings, every row is computed, the same bit for bit at 1, 2 and 3 threads, and within fp32
    summation error of float64."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)
    weights, scales, wanted = [], [], []
    for n in (9001, 3, 17003):
        w = torch.randn(n, 64, generator=g) * 0.1
        if isinstance(dtype, str):
            q = quantize(w.unsqueeze(0), BITS[dtype], 32)
            weights.append(q.data[0]), scales.append(q.scale[0])
            wanted.append(quantize_activations(x).double() @ q[0].double().T)
        else:
            weights.append(w.to(dtype)), scales.append(None)
            wanted.append(x.double() @ w.to(dtype).double().T)
    threads = torch.get_num_threads()
    outs = {}
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs[t] = torch.ops.hybrid_moe.matvecs(x, weights, scales, [None] * 3)
    finally:
        torch.set_num_threads(threads)
    for t in (2, 3):
        assert torch.equal(outs[1], outs[t])
    for got, want in zip(outs[1].split([w.shape[0] for w in weights], -1), wanted):
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-3)


def test_matvecs_refuses_mixed_formats_and_misshapen_biases():
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w = torch.randn(8, 64, dtype=torch.bfloat16)
    q = quantize(torch.randn(1, 8, 64), 8, 32)
    with pytest.raises(RuntimeError, match="every weight must share one format"):
        torch.ops.hybrid_moe.matvecs(x, [w, q.data[0]], [None, q.scale[0]], [None, None])
    with pytest.raises(RuntimeError, match="bias 0 must be a CPU tensor \\[N\\]"):
        torch.ops.hybrid_moe.matvecs(x, [w], [None], [torch.zeros(3, dtype=torch.bfloat16)])
    with pytest.raises(RuntimeError, match="one scale and one bias entry"):
        torch.ops.hybrid_moe.matvecs(x, [w], [], [None])


@pytest.mark.parametrize("architecture, dense", [("qwen2_moe", "model"), ("qwen3_moe", "int8")])
def test_decode_step_merges_sibling_linears_into_one_call(architecture, dense, monkeypatch):
    """Compiled with the backend at one token, the linears reading one input (q / k / v projections; a shared
    expert's gate / up) become one `hybrid_moe::matvecs` call each, and the logits equal those of the same step
    compiled without merging, bit for bit."""
    import torch_hybrid_moe as thm
    from torch_hybrid_moe.compile_passes.backend import hybrid_moe_backend

    model = thm.patch_model(
        tiny_model(architecture, dtype=torch.bfloat16),
        expert_budget=0.0,
        device="cpu",
        dense_weight_dtype=dense,
        cpu_weight_group_size=32,
    )
    for m in model.modules():
        if isinstance(m, dense_linear.RoutedLinear | dense_linear.QuantizedLinear):
            m.max_tokens = 4  # decode rows on the micro-kernels whatever this machine measured for tiny shapes
    targets = (torch.ops.hybrid_moe.matvecs, torch.ops.hybrid_moe.matvecs.default)
    calls: list[tuple[int, int, int, int]] = []

    def counted(gm):
        before = [n for n in gm.graph.nodes if n.target in targets]
        inputs = len({n.args[0] for n in before})
        merged = dense_pass.fuse_sibling_matvecs(gm)
        calls.append((len(before), inputs, merged, sum(n.target in targets for n in gm.graph.nodes)))
        return merged

    x = torch.randint(3, 96, (1, 1))
    logits = []
    for fuse in (lambda gm: 0, counted):
        monkeypatch.setattr("torch_hybrid_moe.compile_passes.backend.fuse_sibling_matvecs", fuse)
        torch._dynamo.reset()
        with torch.no_grad():
            logits.append(torch.compile(model, backend=hybrid_moe_backend, fullgraph=True)(x).logits)
    ((before, inputs, merged, after),) = calls
    # one call per input read (q / k / v; the shared expert's gate / up and its gate; a dense MLP's gate / up)
    assert after == inputs == before - merged and merged >= 2 * model.config.num_hidden_layers
    assert torch.equal(logits[0], logits[1])


def test_siblings_with_an_in_place_write_between_them_are_not_merged(monkeypatch):
    """`q = lin(x); x.mul_(2); k = lin(x)`: merged at q's place, k would read x before the write. Compiled, both
    equal the eager module's."""

    class Siblings(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = (torch.nn.Linear(64, 32, bias=False) for _ in range(2))

        def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = h * 1.0
            q = self.q(x)
            x.mul_(2.0)
            return q, self.k(x)

    monkeypatch.setattr(dense_linear, "kernel_token_limit", lambda weight, repeats=5: 4)  # decode rows routed
    torch.manual_seed(0)
    model = Siblings().to(torch.bfloat16).eval()
    h = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(h)
        got = torch.compile(model, backend="hybrid_moe", fullgraph=True)(h)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_routed_linear_keeps_gradients():
    """The micro-kernels have no backward: with gradients wanted a RoutedLinear takes torch's GEMM at any row count."""
    base = torch.nn.Linear(256, 64, bias=True).to(torch.bfloat16)
    routed = dense_linear.RoutedLinear(base)
    routed.max_tokens = 4
    x = torch.randn(1, 256, dtype=torch.bfloat16, requires_grad=True)
    routed(x).float().sum().backward()
    assert x.grad is not None and routed.weight.grad is not None
    torch.testing.assert_close(routed.weight.grad[0].float(), x.detach()[0].float(), rtol=0, atol=0)
