"""Complex rotary products lowered to real arithmetic (compile_passes/complex_products.py): within fp32 rounding of the
exact products (float64), the same bits as torch's complex multiply where that runs vectorised, eager and through the
hybrid_moe backend; nothing rewritten where that would change a value."""

import torch
from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

from torch_hybrid_moe.compile_passes import backend
from torch_hybrid_moe.compile_passes.complex_products import lower_complex_products
from torch_hybrid_moe.tiny_models import tiny_model


def captured(fn, *args):
    """Dynamo's graph of fn(*args), as the hybrid_moe backend receives it, and its inputs (with any module buffers
    it lifted)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    return graphs[0]


def lowered(fn, *args):
    """(rewrites, the rewritten graph, its inputs) for fn(*args)."""
    gm, inputs = captured(fn, *args)
    done = lower_complex_products(gm)
    gm.graph.lint()
    gm.recompile()
    return done, gm, inputs


def exact_rotation(q, k, freqs):
    """apply_rotary_emb's products in float64: the reference both forms round."""

    def rotate(x):
        z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * freqs.unsqueeze(1).to(torch.complex128)).flatten(3)

    return rotate(q), rotate(k)


def assert_rounded_from(got, exact):
    """Each value within a few fp32 roundings of the exact products (two products and a sum)."""
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=4 * torch.finfo(torch.float32).eps * 16)


def rotary_inputs(pairs, seed=0):
    """fp32 query / key rotary parts [B, H, 1, 2 * pairs] and the step's factors [B, 1, pairs] (complex64)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 1, 2 * pairs, generator=g) * 3
    k = torch.randn(2, 1, 1, 2 * pairs, generator=g) * 3
    return q, k, torch.polar(torch.ones(2, 1, pairs), torch.randn(2, 1, pairs, generator=g) * 4)


def test_rotary_products_are_the_exact_ones_rounded_and_the_vectorised_multiplys_bits():
    # 32 pairs a head (DeepSeek-V2-Lite's rotary width): torch's complex multiply runs in whole vectors, so the
    # rewrite gives its bits; 3 pairs: its scalar tail rounds differently, both within fp32 rounding of the exact
    for pairs in (32, 3):
        q, k, freqs = rotary_inputs(pairs)
        want = apply_rotary_emb(q, k, freqs)
        done, gm, inputs = lowered(apply_rotary_emb, q, k, freqs)
        assert done == 2  # the query's and the key's products
        assert not [n for n in gm.graph.nodes if n.target is torch.view_as_complex]
        nodes = list(gm.graph.nodes)  # the factors' view went after the inputs, not among them
        assert all(n.op == "placeholder" for n in nodes[: len(inputs)])
        for got, w, exact in zip(gm(*inputs), want, exact_rotation(q, k, freqs), strict=True):
            assert_rounded_from(got, exact)
            assert_rounded_from(w, exact)
            if pairs == 32:
                assert torch.equal(got, w)


def test_the_backend_lowers_the_models_rotary_step(monkeypatch):
    """The tiny DeepSeek-V2's own rotary embedding (its factors made in the graph by `polar`) through
    torch.compile(backend="hybrid_moe"): the pass fires there, and the compiled step rounds the exact products."""
    rotary = tiny_model("deepseek_v2").model.rotary_emb
    rewrites = []

    def spy(gm):
        rewrites.append(lower_complex_products(gm))
        return rewrites[-1]

    monkeypatch.setattr(backend, "lower_complex_products", spy)
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, p: apply_rotary_emb(q, k, rotary(q, p)), backend="hybrid_moe")
    pairs = rotary.inv_freq.numel()
    for seed in range(3):
        q, k, _ = rotary_inputs(pairs, seed)
        positions = torch.tensor([[5 + seed], [77]])
        freqs = rotary(q, positions)
        for got, exact in zip(step(q, k, positions), exact_rotation(q, k, freqs), strict=True):
            assert_rounded_from(got, exact)
    assert rewrites == [2]


def test_what_a_rewrite_would_change_is_left_alone_or_read_where_the_product_was():
    x = torch.randn(3, 8, 2)
    c = torch.polar(torch.ones(3, 8), torch.randn(3, 8))

    def shared(x, c):  # the complex view is used twice: rewriting one product would leave it computed anyway
        z = torch.view_as_complex(x)
        return torch.view_as_real(z * c), z.abs()

    def mixed(x, c):  # complex64 times complex128 promotes: not the product the pass writes
        return (torch.view_as_real(torch.view_as_complex(x) * c.to(torch.complex128)),)

    def half(x, c):  # complex32: its eager multiply is not these products in fp16
        return (torch.view_as_real(torch.view_as_complex(x.half()) * c.to(torch.complex32)),)

    def keywords(x, c):  # inputs passed by keyword: skipped, not a crash
        return (torch.view_as_real(input=torch.view_as_complex(input=x) * c),)

    for fn in (shared, mixed, half, keywords):
        gm, inputs = captured(fn, x, c)
        before = [n.target for n in gm.graph.nodes]
        assert lower_complex_products(gm) == 0
        assert [n.target for n in gm.graph.nodes] == before

    def mutated(x, c):  # x changes between the product and its view: the rewrite reads x where the product did
        p = torch.view_as_complex(x) * c
        x.add_(1)
        return (torch.view_as_real(p),)

    done, gm, inputs = lowered(mutated, x.clone(), c)
    assert done == 1
    assert torch.equal(gm(x.clone(), c)[0], mutated(x.clone(), c)[0])

    def factor_input(x, c, y):  # the factor an input before another: its view goes after every input
        return (torch.view_as_real(torch.view_as_complex(x) * c) + y,)

    y = torch.randn(3, 8, 2)
    done, gm, inputs = lowered(factor_input, x, c, y)
    nodes = list(gm.graph.nodes)
    assert done == 1 and all(n.op == "placeholder" for n in nodes[: len(inputs)])
    assert torch.equal(gm(*inputs)[0], factor_input(x, c, y)[0])


def test_a_factors_reshaping_moves_onto_its_real_view_only_where_that_is_the_same():
    x = torch.randn(3, 5, 8, 2)
    c = torch.polar(torch.ones(3, 8), torch.randn(3, 8))

    def moved(x, c):  # a negative dim and a device-only .to: the same values reshaped as a real view
        return (torch.view_as_real(torch.view_as_complex(x) * c.unsqueeze(-2).to("cpu")),)

    def kept(x, c):  # a .to with a dtype (here a no-op) would turn the real view complex: it stays before the view
        return (torch.view_as_real(torch.view_as_complex(x) * c.unsqueeze(1).to(torch.complex64)),)

    for fn, below in ((moved, None), (kept, "to")):
        done, gm, inputs = lowered(fn, x, c)
        assert done == 1
        (view,) = [n for n in gm.graph.nodes if n.target is torch.view_as_real]
        assert (view.args[0].target if view.args[0].op == "call_method" else None) == below
        assert torch.equal(gm(*inputs)[0], fn(x, c)[0])  # 8 pairs a row: whole vectors
