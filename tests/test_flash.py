"""The Hopper flash template (codegen/flash.py, codegen/flash_hopper.py): which attention
kernels have the plain form it computes, what the module launches when it is chosen, and,
on a Hopper GPU, its values against eager at ragged sizes."""

import math

import pytest
import torch
from conftest import DEVICE, assert_matches

import eqfuse
from eqfuse.codegen import access, flash
from eqfuse.codegen.module import generate_module
from eqfuse.examples import ATTENTION_EXAMPLES
from eqfuse.runtime import cache
from eqfuse.runtime.compile_worker import _stubbed

LOG2E = 1 / math.log(2)


def kernel_of(name, heads=2, seq=17, d=16, dtype=torch.float16, layout="bhsd"):
    ex = ATTENTION_EXAMPLES[name]
    torch.manual_seed(0)
    inputs = list(ex.make_inputs(2, heads, seq, d, dtype, DEVICE))
    if layout == "bshd":  # q, k, v as a projection leaves them: [B, S, H, D] seen as [B, H, S, D]
        inputs[:3] = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in inputs[:3]]
    if layout == "kt":  # k stored transposed, [B, H, D, S]: its keys contiguous
        inputs[1] = inputs[1].transpose(-1, -2).contiguous().transpose(-1, -2)
    compiled = eqfuse.compile(ex.fn, tuple(inputs), autotune=False)
    (k,) = compiled.kernels
    return compiled, k, inputs


@pytest.mark.parametrize("name,causal", [("attention", False), ("attention_scale_on_q", False),
                                         ("causal_attention", True), ("causal_attention_where", True),
                                         ("causal_attention_bias", True), ("sdpa_causal", True),
                                         ("sdpa_bool_causal", True)])
def test_plain_spellings_have_the_flash_form(name, causal):
    compiled, k, inputs = kernel_of(name)
    f = flash.form(k.spec, k.schedule.band, k.schedule.m)
    assert f is not None, name
    assert f.band_hi == (0 if causal else None)
    assert [f.q.buf, f.k.buf, f.v.buf] == [b.name for b in compiled.plan.inputs[:3]]
    assert f.scale == pytest.approx(LOG2E / 4)  # 1/sqrt(16) in log2 units, wherever it was written
    assert (f.q.row_stride, f.k.row_stride, f.q.batch_strides) == (16, 16, (2 * 17 * 16, 17 * 16))


def test_operands_in_a_projections_layout_keep_their_strides():
    _, k, _ = kernel_of("causal_attention", heads=3, layout="bshd")
    f = flash.form(k.spec, k.schedule.band, k.schedule.m)
    assert (f.q.row_stride, f.q.batch_strides) == (3 * 16, (17 * 3 * 16, 16))
    assert not f.k_transposed


@pytest.mark.parametrize("seq", [24, 40])
def test_k_stored_transposed_is_read_by_its_rows_of_d(seq):
    """k laid out [B, H, D, S] (Llama's plan writes k so after its rotary embedding): the
    template reads k^T's [D, BLOCK_N] boxes, rows of D at a stride of S, heads x D rows
    collapsing into one box."""
    _, k, _ = kernel_of("causal_attention", heads=3, seq=seq, layout="kt")
    f = flash.form(k.spec, k.schedule.band, k.schedule.m)
    assert f.k_transposed
    assert (f.k.row_stride, f.k.batch_strides) == (seq, (3 * 16 * seq, 16 * seq))
    assert f.collapsible


def test_the_module_hands_k_stored_transposed_to_the_persistent_template(monkeypatch):
    _, info, _, _ = flash_module(monkeypatch, "causal_attention", PERSISTENT, heads=3, seq=128, d=64, layout="kt")
    c = info.constexprs
    assert c["KT"] and c["PROGRAMS"] > 0
    assert (c["SKN"], c["SKH"], c["SKB"]) == (128, 64 * 128, 3 * 64 * 128)  # rows of D, heads, batch
    assert (c["SQM"], c["SVN"]) == (64, 64)  # q and v as before


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_grouped_query_attention_reads_each_stored_kv_head_for_its_group(layout):
    """k through repeat_interleave, v through expand and reshape (transformers' repeat_kv):
    the template reads the stored heads, q's head h reading k's and v's head h // 2."""
    _, k, _ = kernel_of("gqa_attention", heads=4, seq=32, layout=layout)
    f = flash.form(k.spec, k.schedule.band, k.schedule.m)
    assert f is not None and (f.k.group, f.v.group, f.q.group) == (2, 2, 1)
    assert f.k.batch_strides == ((2 * 32 * 16, 32 * 16) if layout == "bhsd" else (32 * 2 * 16, 16))
    assert f.collapsible == (layout == "bhsd")


def test_k_stored_transposed_at_an_unaligned_stride_keeps_the_portable_kernel():
    _, k, _ = kernel_of("causal_attention", heads=3, seq=17, layout="kt")  # rows of 34 bytes: no TMA
    assert flash.form(k.spec, k.schedule.band, k.schedule.m) is None


@pytest.mark.parametrize("name", ["padded_attention", "attention_scale_split"])
def test_other_forms_keep_the_portable_kernel(name):
    """A padding mask is a load in the scores; k scaled before its transpose is an index
    map over a product, not a buffer read as stored."""
    _, k, _ = kernel_of(name)
    assert flash.form(k.spec, k.schedule.band, k.schedule.m) is None


def test_odd_head_dims_and_float32_have_no_flash_form():
    for d, dtype in ((8, torch.float16), (16, torch.float32)):
        _, k, _ = kernel_of("attention", d=d, dtype=dtype)
        assert flash.form(k.spec, k.schedule.band, k.schedule.m) is None, (d, dtype)


def test_no_flash_candidate_without_a_hopper_gpu():
    _, k, _ = kernel_of("causal_attention", d=128)
    if not flash.device_supports():
        assert k.schedule.flash is None
        assert not any("FLASH" in c for c in flash.candidates(k.schedule))


PER_PROGRAM = {"FLASH": 1, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
PERSISTENT = {**PER_PROGRAM, "FLASH": 2, "num_stages": 2}
PER_PROGRAM_256 = {**PER_PROGRAM, "BLOCK_N": 64, "num_stages": 2}  # head dims 129 to 256


def flash_module(monkeypatch, name, cfg=PER_PROGRAM, **kw):
    """The module with the kernel as the template, as a Hopper GPU's autotuner would make it."""
    compiled, k, inputs = kernel_of(name, **kw)  # compiled (and run) with the portable kernel
    on_hopper(monkeypatch)
    source, infos = generate_module(compiled.plan, name, "test", {k.name: cfg})
    return compiled, infos[0], source, inputs


def test_persistent_programs_walk_collapsed_operands(monkeypatch):
    _, info, source, _ = flash_module(monkeypatch, "causal_attention", PERSISTENT, heads=3, seq=256, d=64)
    c = info.constexprs
    assert c["PROGRAMS"] > 0 and info.grid == (c["PROGRAMS"],) and (c["BH"], c["STAGES"]) == (6, 2)
    assert info.fallback is not None and info.fallback.params == info.params


@pytest.mark.parametrize("layout,seq", [("bshd", 256), ("bhsd", 200)])
def test_persistent_form_only_where_heads_and_rows_collapse(monkeypatch, layout, seq):
    """Heads interleaved with rows, or a ragged last block (a tile would reach into the next
    head): one program per block."""
    _, k, _ = kernel_of("attention", heads=3, seq=seq, d=64, layout=layout)
    sched = hopper_schedule(monkeypatch, k)
    assert sched.flash is not None
    assert not any(c["FLASH"] == 2 for c in flash.candidates(sched))


def on_hopper(monkeypatch):
    """Code generation as on a Hopper GPU (an H100's SMs and L2 where there is none)."""
    monkeypatch.setattr(flash, "device_supports", lambda: True)
    if not torch.cuda.is_available():  # the persistent form asks the GPU for its SMs and L2
        monkeypatch.setattr(flash, "persistent_programs", lambda heads, m, n, d, item, block_m: (132, 24))


def hopper_schedule(monkeypatch, k):
    """The schedule a Hopper GPU gives the kernel ``k`` (compiled here with the portable
    kernel: the template does not run on the CPU)."""
    from eqfuse.codegen.schedules import schedule_of
    on_hopper(monkeypatch)
    return schedule_of(k.spec)


def test_per_program_form_only_at_head_dim_128(monkeypatch):
    _, k64, _ = kernel_of("attention", heads=3, seq=256, d=64)
    _, k128, _ = kernel_of("attention", heads=3, seq=256, d=128)
    assert [c["FLASH"] for c in flash.candidates(hopper_schedule(monkeypatch, k64))] == [2]
    assert sorted(c["FLASH"] for c in flash.candidates(hopper_schedule(monkeypatch, k128))) == [1, 1, 2]


@pytest.mark.parametrize("layout,persistent", [("bhsd", True), ("kt", False)])
def test_a_head_dim_under_a_power_of_two_runs_in_tiles_of_the_next(monkeypatch, layout, persistent):
    """D = 96 computes as 128 (TMA fills the columns past 96 with zeros); k stored
    transposed has 96 rows a head, which a persistent box of 128 would overrun."""
    _, k, _ = kernel_of("causal_attention", heads=3, seq=256, d=96, layout=layout)
    sched = hopper_schedule(monkeypatch, k)
    forms = sorted(c["FLASH"] for c in flash.candidates(sched))
    assert forms == ([1, 1, 2] if persistent else [1, 1])
    compiled, info, _, _ = flash_module(monkeypatch, "causal_attention", heads=3, seq=256, d=96, layout=layout)
    assert (info.constexprs["D"], info.constexprs["DP"]) == (96, 128)


def test_an_untuned_build_runs_the_template_in_tiles_128_wide_only(monkeypatch):
    """The first candidate is the untuned configuration: the template's at head dims 96
    and 128 (faster wherever measured), the portable kernel's at 64 (within 8% either way)."""
    from eqfuse.codegen import attention
    from eqfuse.codegen.configs import default_config
    kernels = {d: kernel_of("attention", heads=3, seq=256, d=d)[1] for d in (128, 96, 64)}
    for d, first in ((128, 2), (96, 2), (64, None)):
        sched = hopper_schedule(monkeypatch, kernels[d])
        assert attention.candidates(sched)[0].get("FLASH") == first
        assert default_config(sched) == attention.candidates(sched)[0]


def test_head_dims_to_256_run_in_tiles_256_wide_and_keys_64_at_a_time(monkeypatch):
    """At head dims 129 to 256 the template has one configuration (a program per query
    block, key tiles of 64 rows, two ring slots: q and the K and V rings take 192 KiB of
    shared memory), the untuned build's first; past 256, no form."""
    from eqfuse.codegen import attention
    for d in (192, 256):
        _, k, _ = kernel_of("causal_attention", seq=17, d=d)
        candidates = attention.candidates(hopper_schedule(monkeypatch, k))
        assert candidates[0] == PER_PROGRAM_256
        assert sum("FLASH" in c for c in candidates) == 1
    _, info, _, _ = flash_module(monkeypatch, "causal_attention", PER_PROGRAM_256, seq=17, d=192)
    assert (info.constexprs["D"], info.constexprs["DP"], info.constexprs["BLOCK_N"]) == (192, 256, 64)
    _, k, _ = kernel_of("attention", seq=17, d=272)
    assert flash.form(k.spec, k.schedule.band, k.schedule.m) is None


def test_the_module_launches_the_template_with_the_portable_kernel_for_unaligned_addresses(monkeypatch):
    compiled, info, source, _ = flash_module(monkeypatch, "causal_attention", heads=3, seq=100, d=128)
    assert f"from eqfuse.codegen.flash_hopper import flash_attention_hopper as {info.name}" in source
    c = info.constexprs
    assert (c["H"], c["M"], c["N"], c["D"], c["CAUSAL"], c["BAND_HI"], c["STAGES"]) == (3, 100, 100, 128, True, 0, 3)
    assert c["SCALE"] == pytest.approx(LOG2E / math.sqrt(128))
    assert info.launch == {"num_warps": 4, "maxnreg": 168}
    assert info.template == "the Hopper flash template, a program per query block" and info.config == PER_PROGRAM
    assert info.grid == (1, 6)
    # the portable kernel takes the same arguments in the same order
    assert info.fallback is not None and info.fallback.params == info.params
    assert "FLASH" not in info.fallback.constexprs and f"{info.name}_unaligned_launch" in source


def test_a_sized_module_keeps_the_portable_kernel(monkeypatch):
    """Sizes taken at launch: the template's are constexprs."""
    from eqfuse.codegen.kernel import generate_kernel
    compiled, info, _, _ = flash_module(monkeypatch, "attention", d=128)
    cfg = {"FLASH": 1, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
    g = generate_kernel(compiled.plan.kernels[0], compiled.plan.buffers, cfg, runtime=frozenset({"M", "N"}))
    assert g.constexprs is None and "@triton.jit" in g.text
    assert "FLASH" not in g.cfg and "FLASH" not in g.text  # the portable kernel's own configuration


def test_the_compile_worker_stubs_a_template_import():
    line = "from eqfuse.codegen.flash_hopper import flash_attention_hopper as k0_view_5"
    assert _stubbed(line) == "k0_view_5 = _eqfuse_stub"
    assert _stubbed("x = 1") == "x = 1"


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


CASES = [(PER_PROGRAM, 128, seq, layout) for seq in (1, 17, 100, 300) for layout in ("bhsd", "bshd")] + \
    [(PER_PROGRAM, 128, seq, "kt") for seq in (24, 104, 304)] + \
    [(PERSISTENT, d, seq, layout) for d in (64, 128) for seq in (128, 384) for layout in ("bhsd", "kt")] + \
    [(PER_PROGRAM, 96, seq, layout) for seq in (17, 300) for layout in ("bhsd", "bshd")] + \
    [(PER_PROGRAM, 96, seq, "kt") for seq in (24, 104)] + \
    [(PERSISTENT, 96, 384, "bhsd")] + \
    [(PER_PROGRAM_256, d, seq, layout) for d in (192, 256) for seq in (17, 300) for layout in ("bhsd", "bshd")] + \
    [(PER_PROGRAM_256, 256, 104, "kt")]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the template needs a Hopper GPU (sm_90a)")
@pytest.mark.parametrize("cfg,d,seq,layout", CASES)
@pytest.mark.parametrize("name", ["attention", "attention_scale_on_q", "causal_attention", "causal_attention_where",
                                  "sdpa_causal", "gqa_attention"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_template_matches_eager(monkeypatch, name, cfg, d, seq, layout, dtype):
    heads = 4 if name == "gqa_attention" else 3  # two stored heads of k and v, each for two of q's
    compiled, info, source, inputs = flash_module(monkeypatch, name, cfg, heads=heads, seq=seq, d=d, dtype=dtype,
                                                  layout=layout)
    # one row, causal: the mask folds to nothing, and the portable kernel runs
    assert "PROGRAMS" in info.constexprs or (seq == 1 and name != "attention")
    assert info.constexprs.get("PROGRAMS", 0) > 0 or cfg["FLASH"] == 1
    module = cache.load_module(cache.cache_key(source, DEVICE), source, interpret=False)
    got = module.call(inputs[0].device, [], *inputs)[0]
    assert_matches(got, ATTENTION_EXAMPLES[name].fn(*inputs), contraction=True)


COMPILE_FOR_SM90 = """
import json, math, sys
import triton
from triton.backends.compiler import GPUTarget
from eqfuse.codegen import flash_hopper
from eqfuse.runtime.compile_worker import ast_source

fn = flash_hopper.flash_attention_hopper
out = []
for programs, causal, stages, kt, group, d, dp, block_n in (
        (0, True, 3, False, 1, 128, 128, 128), (132, False, 2, False, 1, 128, 128, 128),
        (132, True, 2, True, 1, 128, 128, 128), (0, True, 3, False, 4, 128, 128, 128),
        (132, True, 2, False, 2, 128, 128, 128), (0, True, 3, True, 1, 96, 128, 128),
        (132, True, 2, False, 1, 96, 128, 128), (0, True, 2, False, 2, 256, 256, 64),
        (0, False, 2, True, 1, 192, 256, 64)):
    sig = {p: "*fp16" if p.endswith("_ptr") else "constexpr" for p in fn.arg_names}
    cx = dict(H=4, M=512, N=512, D=d, DP=dp, OQ=0, OK=0, OV=0, OO=0, SCALE=0.1, CAUSAL=causal, BAND_HI=0,
              BLOCK_M=128, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=flash_hopper.CONSUMER_REGS, BH=8,
              PROGRAMS=programs, CHUNK=4, KT=kt, GROUP=group)
    for t, rows in (("Q", "M"), ("K", "N"), ("V", "N"), ("O", "M")):
        cx.update({f"S{t}B": 4 * 512 * d, f"S{t}H": 512 * d, f"S{t}{rows}": d})
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.arg_names) if p.endswith("_ptr")}
    k = triton.compile(ast_source(fn, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "maxnreg": flash_hopper.MAXNREG})
    ptx = k.asm["ptx"]
    out.append({"shared": k.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"),
                "setmaxnreg": "setmaxnreg" in ptx, "sass": len(k.asm["cubin"])})
print(json.dumps(out))
"""


def test_the_template_compiles_for_sm90_without_a_gpu():
    """Triton's compiler and its bundled ptxas need no GPU: both forms build for Hopper
    (with k and v shared by groups of heads too, at a head dim of 96 in tiles of 128, and at 192
    and 256 in tiles of 256 with keys 64 at a time),
    with their products on wgmma, registers handed from the loader to the consumers, and
    shared memory under the H100's 227 KB (in a child process: one that interprets Triton
    kernels cannot compile them)."""
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(eqfuse.__file__)),
                                                    env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for kernel in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert kernel["shared"] <= 232448 and kernel["wgmma"] >= 16 and kernel["setmaxnreg"] and kernel["sass"]


def fused_qkv_attention(qkv):
    """q, k and v split from one projection's output [batch, seq, 3 * heads * 128]."""
    b, s, _ = qkv.shape
    q, k, v = qkv.view(b, s, 3, -1, 128).permute(2, 0, 3, 1, 4)
    return ATTENTION_EXAMPLES["causal_attention"].fn(q, k, v)


def test_operands_split_from_one_projection_are_read_where_they_lie(monkeypatch):
    monkeypatch.setattr(flash, "device_supports", lambda: True)
    qkv = torch.randn(2, 33, 3 * 2 * 128, dtype=torch.float16)
    c = eqfuse.compile(fused_qkv_attention, (qkv,), autotune=False)
    (k,) = [k for k in c.kernels if k.schedule.kind == "attention"]
    f = flash.form(k.spec, k.schedule.band, k.schedule.m)
    assert f is not None and not f.collapsible  # heads lie between rows: no persistent form
    assert [c["FLASH"] for c in flash.candidates(k.schedule)] == [1, 1]
    assert (f.q.offset, f.k.offset, f.v.offset) == (0, 256, 512)
    assert (f.q.row_stride, f.q.batch_strides) == (768, (33 * 768, 128))


def fused_qkv_module(monkeypatch, dtype=torch.float16):
    monkeypatch.setattr(flash, "device_supports", lambda: True)
    torch.manual_seed(0)
    qkv = torch.randn(2, 100, 3 * 2 * 128, dtype=dtype)
    c = eqfuse.compile(fused_qkv_attention, (qkv,), autotune=False)
    (k,) = c.kernels
    source, (info,) = generate_module(c.plan, "fused_qkv", "test", {k.name: PER_PROGRAM})
    return qkv, info, source


def test_a_shared_buffer_is_passed_once_to_the_portable_twin(monkeypatch):
    _, info, source = fused_qkv_module(monkeypatch)
    assert info.params == ["in0", "in0", "in0", info.params[3]] and info.fallback.params == ["in0", info.params[3]]
    assert "picks=(0, 3)" in source


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the template needs a Hopper GPU (sm_90a)")
def test_template_on_a_shared_buffer_aligned_or_not(monkeypatch):
    qkv, info, source = fused_qkv_module(monkeypatch)
    module = cache.load_module(cache.cache_key(source, DEVICE), source, interpret=False)
    shifted = torch.empty(qkv.numel() + 1, dtype=qkv.dtype)[1:].view(qkv.shape)  # 2 bytes off 16
    shifted.copy_(qkv)
    for x in (qkv, shifted):
        assert_matches(module.call(x.device, [], x)[0], fused_qkv_attention(x), contraction=True)


def test_index_maps_over_a_load_are_read_as_the_view_torch_makes():
    """GPT-2's q: a slice of the projection's output, split into heads, transposed."""
    from eqfuse.schema.plan import PNode
    load = PNode("load", ("buf", (196608, 768, 1), 0), (), (2, 256, 768), "float16")
    part = PNode("slice", (2, 256, 1), (load,), (2, 256, 256), "float16")
    heads = PNode("reshape", (), (part,), (2, 256, 2, 128), "float16")
    q = PNode("permute", ((0, 2, 1, 3),), (heads,), (2, 2, 256, 128), "float16")
    ref = torch.empty(2 * 196608, device="meta").as_strided((2, 256, 768), (196608, 768, 1))
    ref = ref[:, :, 256:512].reshape(2, 256, 2, 128).permute(0, 2, 1, 3)
    buf, view = access.strided_view(q)
    assert (buf, view.stride(), view.storage_offset()) == ("buf", ref.stride(), ref.storage_offset())
    wide = PNode("reshape", (), (PNode("permute", ((0, 2, 1),), (load,), (2, 768, 256), "float16"),),
                 (2, 768 * 256), "float16")
    assert access.strided_view(wide) is None  # a reshape no view of those strides can make


@pytest.mark.parametrize("d", [128, 256])
def test_on_hopper_a_prologue_on_q_leaves_the_attention_kernel_for_the_template(monkeypatch, d):
    """At head dims 128 and 256 the portable kernel is costed at its measured rate where the
    template runs (rewrite/cost.py): at Llama's sizes, q's pointwise prologue becomes a
    kernel of its own and the attention runs as the template; without a Hopper GPU the
    prologue stays fused. Extraction only: nothing runs."""
    from eqfuse.codegen import tma
    from eqfuse.pipeline import build
    from eqfuse.runtime.compiled import Options
    causal = ATTENTION_EXAMPLES["causal_attention"].fn

    def scaled_q_attention(q, k, v, w):
        return causal(q * w, k, v)

    inputs = [torch.empty(4, 32, 2048, d, dtype=torch.float16) for _ in range(3)] + \
        [torch.empty(d, dtype=torch.float16)]
    monkeypatch.setattr(tma, "sm_count", lambda: 132)
    plans = {}
    for hopper in (False, True):
        if hopper:
            on_hopper(monkeypatch)
        else:
            monkeypatch.setattr(flash, "device_supports", lambda: False)
        monkeypatch.setattr(tma, "device_supports", lambda hopper=hopper: hopper)
        res = build(scaled_q_attention, inputs, Options(validate=False, autotune=False, plan_cache=False))
        plans[hopper] = [(k.schedule.kind, k.schedule.flash is not None) for k in res["kernels"]]
    assert plans[False] == [("attention", False)]
    assert plans[True] == [("pointwise", False), ("attention", True)]
