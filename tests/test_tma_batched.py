"""The TMA form of batched products (codegen/tma.py, codegen/tiles.py): which ones can take
it, when the tile model offers it, and that the form, forced with a config, computes what
eager does (the interpreter runs tensor descriptors too; on a GPU, compiled)."""

import math

import pytest
import torch
from conftest import DEVICE, assert_matches

import eqfuse
from eqfuse.codegen import configs, tiles, tma
from eqfuse.codegen.schedules import Schedule

H, BF, F32 = torch.float16, torch.bfloat16, torch.float32
TMA_CFG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 3, "PROGRAMS": 5}


def bmm(a, b):
    return a @ b


def scores_causal(q, k):
    """Llama's attention scores: q @ k^T, scaled, a causal mask from index comparisons."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i, j = torch.arange(q.shape[-2], device=q.device), torch.arange(k.shape[-2], device=q.device)
    return torch.where(j[None, :] > i[:, None], -float("inf"), s)


def scores_mask_input(q, k, mask):
    """The same with the mask a tensor: an M x N tile read in the epilogue."""
    return torch.where(mask, -float("inf"), q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))


def pt_v(p, v):
    """dV = P^T @ dO: A read along M (its transpose is what is stored)."""
    return p.transpose(-1, -2) @ v


def shared_weight(a, w):
    """[2, 3, M, K] @ [K, N] broadcast over the batch: B's box is 2-D."""
    return torch.matmul(a, w.expand(2, 3, *w.shape))


def prologue(a, b):
    return (a * 2 + 1) @ b


def tanh_epilogue(a, b, bias):
    """A special function in the epilogue: computed half a tile at a time."""
    return torch.tanh(a @ b + bias)


def _cases(dtype):
    r = lambda *s: torch.randn(*s, dtype=dtype, device=DEVICE)  # noqa: E731
    return {
        "bmm": (bmm, (r(3, 33, 40), r(3, 40, 56))),
        "scores causal": (scores_causal, (r(2, 3, 33, 40), r(2, 3, 56, 40))),
        "scores mask input": (scores_mask_input, (r(2, 3, 33, 40), r(2, 3, 56, 40),
                                                  torch.rand(33, 56, device=DEVICE) > 0.7)),
        "P^T @ V": (pt_v, (r(3, 56, 40), r(3, 56, 48))),
        "shared weight": (shared_weight, (r(2, 3, 33, 40), r(40, 48))),
        "tanh epilogue": (tanh_epilogue, (r(3, 33, 40), r(3, 40, 56), r(56))),
    }


def _kernel(fn, inputs):
    compiled = eqfuse.compile(fn, inputs)
    (k,) = [k for k in compiled.kernels if k.schedule.kind == "matmul"]
    return compiled, k


@pytest.mark.parametrize("case,expected", [
    ("bmm", True), ("scores causal", True), ("scores mask input", True), ("P^T @ V", True),
    ("shared weight", True), ("K=17 (34-byte rows)", False), ("batch dims that do not fold", False),
    ("prologue", False),
])
def test_which_batched_matmuls_can_take_the_tma_form(case, expected):
    cases = _cases(H)
    cases["K=17 (34-byte rows)"] = (bmm, (torch.randn(3, 33, 17, dtype=H), torch.randn(3, 17, 48, dtype=H)))
    # [2, 3] batch read as [3, 2] transposed: no single stride walks the batch index
    cases["batch dims that do not fold"] = (bmm, (torch.randn(3, 2, 33, 40, dtype=H).transpose(0, 1),
                                                  torch.randn(2, 3, 40, 48, dtype=H)))
    cases["prologue"] = (prologue, (torch.randn(3, 33, 40, dtype=H), torch.randn(3, 40, 48, dtype=H)))
    fn, inputs = cases[case]
    _, k = _kernel(fn, inputs)
    assert k.schedule.batch, k.schedule
    assert k.schedule.tma is expected, k.source


def test_epilogue_tile_reads_are_counted():
    _, plain = _kernel(*_cases(H)["scores causal"])
    _, masked = _kernel(*_cases(H)["scores mask input"])
    assert plain.schedule.tile_reads == 0  # the causal mask is computed from the indices
    assert masked.schedule.tile_reads == 1


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(tma, "device_supports", lambda: True)
    monkeypatch.setattr(tma, "sm_count", lambda: 132)


LLAMA = dict(batch=(8, 32), dot_dtype="float16", dots=1, tma=True)


def test_model_picks_the_tma_form_for_llamas_scores_and_not_for_its_long_k_products(hopper):
    """256 x [2048 x 128] @ [128 x 2048]: the store outlasts the K loop, the TMA form comes
    first, with larger tiles (measured on an H100: 128 x 256 919 us, 128 x 128 1086); the
    K = 2048 products (P @ V) are not offered it (1-5% slower there); nor are the scores
    when the mask is a tensor read in the epilogue (1758 us against 1450)."""
    scores = Schedule("matmul", m=2048, n=2048, k=128, **LLAMA)
    best = tiles.ranked(scores)[0]
    assert "PROGRAMS" in best and best["BLOCK_M"] * best["BLOCK_N"] == 128 * 256, best
    assert best["PROGRAMS"] == 132  # one per SM: tiles of every matrix count
    assert configs.default_config(scores) == best
    pv = Schedule("matmul", m=2048, n=128, k=2048, **LLAMA)
    assert not any("PROGRAMS" in c for c in tiles.candidates(pv))
    without = tiles.ranked(pv)
    assert without == tiles.ranked(Schedule("matmul", m=2048, n=128, k=2048, batch=(8, 32),
                                            dot_dtype="float16", dots=1))
    masked = Schedule("matmul", m=2048, n=2048, k=128, tile_reads=1, **LLAMA)
    assert not any("PROGRAMS" in c for c in tiles.candidates(masked))
    # A single matrix keeps the form wherever it can take it, as before
    single = Schedule("matmul", m=4096, n=4096, k=4096, dot_dtype="float16", dots=1, tma=True)
    assert any("PROGRAMS" in c for c in tiles.candidates(single))


def test_compiled_scores_offer_the_tma_form_where_it_pays(hopper):
    # Offered among the candidates; at these few tiles the model ranks it after one program
    # per tile (each program first makes its descriptors), so the autotuner's finalists may not hold it
    _, k = _kernel(*_cases(H)["scores causal"])
    offered = [c for c in tiles.candidates(k.schedule) if "PROGRAMS" in c]
    assert offered and all(configs.fits(k.schedule, c) for c in offered)
    n_tiles = lambda c: 6 * -(-33 // c["BLOCK_M"]) * -(-56 // c["BLOCK_N"])  # noqa: E731
    assert all(c["PROGRAMS"] == min(132, n_tiles(c)) for c in offered)
    _, masked = _kernel(*_cases(H)["scores mask input"])
    assert masked.schedule.tma and not any("PROGRAMS" in c for c in tiles.candidates(masked.schedule))
    assert configs.fits(masked.schedule, TMA_CFG)  # still runnable when forced


def _forced(compiled, k, cfg=TMA_CFG):
    from eqfuse.codegen.module import generate_module
    from eqfuse.runtime.cache import cache_key, load_module
    source, infos = generate_module(compiled.plan, "tma", "test", {k.name: cfg})
    info = next(i for i in infos if i.name == k.name)
    return load_module(cache_key(source), source, interpret=DEVICE == "cpu"), info


@pytest.mark.parametrize("dtype", [H, BF, F32], ids=str)
@pytest.mark.parametrize("case", ["bmm", "scores causal", "scores mask input", "P^T @ V", "shared weight",
                                  "tanh epilogue"])
def test_batched_tma_form_matches_eager(case, dtype):
    """Odd sizes (M = 33 with 32-row tiles: the second tile of each matrix hangs over its
    edge and must read zeros, not the next matrix's rows), transposed operands, an
    epilogue, a weight shared by the batch; operands and output through 3-D descriptors."""
    torch.manual_seed(0)
    fn, inputs = _cases(dtype)[case]
    compiled, k = _kernel(fn, inputs)
    assert k.schedule.tma
    module, info = _forced(compiled, k)
    src = info.source
    assert info.grid == (5, 1) and info.fallback is not None
    assert "flatten=True" in src and "bindex = (tile // (tiles_m * tiles_n))" in src
    loop = src.split("for k0")[1].split("acc1 = tl.dot")[0]
    assert "tl.load(" not in loop and ".reshape(BLOCK_" in loop  # operands by TMA, one matrix deep
    assert ".store([bindex, pid_m * BLOCK_M" in src  # the output through a 3-D descriptor
    if case == "shared weight":
        assert "shape=[40, 48]" in src  # B unbatched: a 2-D box, no batch coordinate
    assert ("for half in tl.static_range(2)" in src) == (case == "tanh epilogue")
    (out,) = module.call(inputs[0].device, [], *inputs)
    assert_matches(out, fn(*inputs), contraction=True)


def test_batched_tma_kernel_runs_its_pointer_twin_for_an_unaligned_input():
    fn, (a, b) = _cases(H)["bmm"]
    compiled, k = _kernel(fn, (a, b))
    module, _ = _forced(compiled, k)
    launcher = getattr(module, f"{k.name}_launch")
    calls, twin = [], launcher.otherwise
    launcher.otherwise = lambda *t: (calls.append(1), twin(*t))
    shifted = torch.empty(a.numel() + 1, dtype=a.dtype, device=a.device)[1:].view_as(a)
    shifted.copy_(a)
    assert shifted.data_ptr() % 16
    (out,) = module.call(a.device, [], shifted, b)
    assert calls == [1]
    assert_matches(out, fn(a, b), contraction=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [H, BF, F32], ids=str)
@pytest.mark.parametrize("case", ["bmm", "scores causal", "scores mask input", "P^T @ V", "shared weight"])
def test_batched_tma_form_on_the_gpu(case, dtype):
    """Compiled on a Hopper GPU, at the odd sizes and with Hopper-sized tiles, through the
    launcher's C path (first call through the JIT, later ones direct), and the autotuned
    build (offered both forms where the model offers TMA) against eager."""
    if not tma.device_supports():
        pytest.skip("TMA needs compute capability 9.0")
    torch.manual_seed(0)
    fn, inputs = _cases(dtype)[case]
    compiled = eqfuse.compile(fn, inputs, autotune=dtype == H)  # the autotuner's trials once per case
    (k,) = [k for k in compiled.kernels if k.schedule.kind == "matmul"]
    assert k.schedule.tma
    ref = fn(*inputs)
    for cfg in (TMA_CFG, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4,
                          "num_stages": 3, "PROGRAMS": 7}):
        module, _ = _forced(compiled, k, cfg)
        for _ in range(2):
            (out,) = module.call(inputs[0].device, [], *inputs)
            assert_matches(out, ref, contraction=True)
    assert_matches(compiled(*inputs), ref, contraction=True)
