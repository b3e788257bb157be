"""Complex rotary products lowered to real arithmetic (compile_passes/complex_products.py): the same bits as torch's
complex multiply, eager and through Inductor, and nothing rewritten where a complex value has another use."""

import torch
from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

from torch_hybrid_moe.compile_passes.complex_products import lower_complex_products
from torch_hybrid_moe.tiny_models import tiny_model


def captured(fn, *args):
    """Dynamo's graph of fn(*args), as the hybrid_moe backend receives it, and its inputs (with any module buffers
    it lifted)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def complex_nodes(gm):
    return [n for n in gm.graph.nodes if n.target in (torch.view_as_complex, torch.polar)]


def rotary_inputs(seed=0):
    """DeepSeek-V2's rotary step as a decode step runs it: bf16 query / key rotary parts [B, H, 1, rot], the tiny
    model's rotary factors (yarn-scaled) at one position per row."""
    rotary = tiny_model("deepseek_v2").model.rotary_emb
    g = torch.Generator().manual_seed(seed)
    rot = 2 * rotary.inv_freq.numel()
    q = (torch.randn(2, 4, 1, rot, generator=g) * 3).bfloat16()
    k = (torch.randn(2, 1, 1, rot, generator=g) * 3).bfloat16()
    return rotary, q, k, torch.tensor([[5], [77]])


def rotate(rotary, q, k, positions):
    return apply_rotary_emb(q, k, rotary(q, positions))


def test_rotary_products_run_in_real_arithmetic_with_the_same_bits():
    rotary, q, k, positions = rotary_inputs()
    want = rotate(rotary, q, k, positions)
    gm, inputs = captured(lambda q, k, p: rotate(rotary, q, k, p), q, k, positions)
    assert lower_complex_products(gm) == 2  # the query's and the key's products
    # what is left complex: the step's factors (polar, once), read through one view
    assert [n.target for n in complex_nodes(gm)] == [torch.polar]
    (view,) = [n for n in gm.graph.nodes if n.target is torch.view_as_real]
    assert view.args[0].target not in ("unsqueeze", "to")  # the factors' per-layer reshaping runs on the real view
    for got, w in zip(gm(*inputs), want, strict=True):
        assert torch.equal(got, w)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, p: rotate(rotary, q, k, p), backend="hybrid_moe")
    for seed in range(3):
        rotary, q, k, positions = rotary_inputs(seed)
        for got, w in zip(compiled(q, k, positions), rotate(rotary, q, k, positions), strict=True):
            assert torch.equal(got, w)


def test_complex_values_with_other_uses_and_mixed_dtypes_are_left_alone():
    x = torch.randn(3, 8, 2)
    c = torch.polar(torch.ones(3, 8), torch.randn(3, 8))

    def shared(x, c):  # the complex view is used twice: rewriting one product would leave it computed anyway
        z = torch.view_as_complex(x)
        return torch.view_as_real(z * c), z.abs()

    def mixed(x, c):  # complex64 times complex128 promotes: not the product the pass writes
        return (torch.view_as_real(torch.view_as_complex(x) * c.to(torch.complex128)),)

    for fn in (shared, mixed):
        gm, inputs = captured(fn, x, c)
        before = [n.target for n in gm.graph.nodes]
        assert lower_complex_products(gm) == 0
        assert [n.target for n in gm.graph.nodes] == before
        for got, want in zip(gm(*inputs), fn(x, c), strict=True):
            assert torch.equal(got, want)


def test_a_factors_reshaping_moves_onto_its_real_view_only_where_that_is_the_same():
    x = torch.randn(3, 5, 8, 2)
    c = torch.polar(torch.ones(3, 8), torch.randn(3, 8))

    def moved(x, c):  # a negative dim and a device-only .to: the same values reshaped as a real view
        return (torch.view_as_real(torch.view_as_complex(x) * c.unsqueeze(-2).to("cpu")),)

    def kept(x, c):  # a .to with a dtype (here a no-op) would turn the real view complex: it stays before the view
        return (torch.view_as_real(torch.view_as_complex(x) * c.unsqueeze(1).to(torch.complex64)),)

    for fn, below in ((moved, None), (kept, "to")):
        gm, inputs = captured(fn, x, c)
        assert lower_complex_products(gm) == 1
        (view,) = [n for n in gm.graph.nodes if n.target is torch.view_as_real]
        assert (view.args[0].target if view.args[0].op == "call_method" else None) == below
        assert torch.equal(gm(*inputs)[0], fn(x, c)[0])
