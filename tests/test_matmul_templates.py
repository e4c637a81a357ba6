"""The Hopper matmul templates, ping-pong and cooperative (codegen/matmul_templates.py,
codegen/matmul_hopper.py): which matmul kernels they can run, the epilogue they are handed
(the Triton kernel's, spelled in Gluon), what the module launches when one is chosen, that
they build for sm_90 without a GPU, and, on a Hopper GPU, their values against eager at
ragged sizes."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, assert_matches

import eqfuse
from eqfuse.codegen import flash
from eqfuse.codegen import matmul_templates as templates
from eqfuse.codegen.module import generate_module
from eqfuse.runtime import cache
from eqfuse.runtime.compile_worker import _stubbed, _template


def gelu_bias(x, w, b):
    return F.gelu(x @ w + b)


def gelu_tanh_bias(x, w, b):
    return F.gelu(x @ w + b, approximate="tanh")


def linear_residual(x, w, b, r):  # w stored [N, K]: B read K-major
    return F.linear(x, w, b) + r


def relu_scaled(x, w, b):
    return torch.relu(x @ w) * 0.5 + b


def silu_linear(x, w, b):  # sigmoid, which Gluon spells otherwise
    return F.silu(F.linear(x, w, b))


FNS = {f.__name__: f for f in (gelu_bias, gelu_tanh_bias, linear_residual, relu_scaled, silu_linear)}
SPECIAL = {"gelu_bias", "gelu_tanh_bias", "silu_linear"}  # epilogues with a special function: chunked


def make_inputs(name, m, n, k, dtype=torch.float16, device=DEVICE):
    g = torch.Generator().manual_seed(m * 7 + n * 3 + k)

    def rand(*shape):
        return (torch.randn(*shape, generator=g, device="cpu") / shape[-1] ** 0.5).to(dtype).to(device)

    w = rand(n, k) if name in ("linear_residual", "silu_linear") else rand(k, n)
    inputs = [rand(m, k), w, rand(n)]
    if name == "linear_residual":
        inputs.append(rand(m, n))
    return inputs


def matmul_kernel(name, m=64, n=72, k=48, dtype=torch.float16):
    inputs = make_inputs(name, m, n, k, dtype)
    compiled = eqfuse.compile(FNS[name], tuple(inputs), autotune=False)
    (kernel,) = [k for k in compiled.kernels if k.schedule.kind == "matmul"]
    return compiled, kernel, inputs


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_products_with_an_epilogue_have_the_template_form(name, dtype):
    compiled, k, _ = matmul_kernel(name, dtype=dtype)
    f = templates.form(k.spec, k.schedule, compiled.plan.buffers)
    assert f is not None, name
    assert (f.a.buf, f.b.buf) == (compiled.plan.inputs[0].name, compiled.plan.inputs[1].name)
    assert (f.b.inner == "kindex_b") == (name in ("linear_residual", "silu_linear"))  # F.linear's weight: K-major
    assert f.lines[-1].startswith("return ") and f.lines[-1].endswith(f".to(gl.{str(dtype)[6:]})")
    assert not any("tl." in line for line in f.lines)
    assert f.acc in f.lines[0] or any(f.acc in line for line in f.lines)
    # the epilogue reads the bias (and the residual), never the operands
    reads = set(f.args)
    assert compiled.plan.inputs[2].name in reads and f.a.buf not in reads and f.b.buf not in reads
    if name == "silu_linear":
        assert any("pingpong_sigmoid(" in line for line in f.lines)


def test_float32_batched_and_unaligned_products_keep_the_triton_kernel():
    """The template takes half-precision operands, one matrix, and TMA's 16-byte strides."""
    x32 = [t.float() for t in make_inputs("gelu_bias", 64, 72, 48)]
    c = eqfuse.compile(gelu_bias, tuple(x32), autotune=False)
    assert templates.form(c.kernels[0].spec, c.kernels[0].schedule, c.plan.buffers) is None
    c, k, _ = matmul_kernel("gelu_bias", k=17)  # rows of A of 34 bytes
    assert not templates.eligible(k.schedule) and templates.form(k.spec, k.schedule, c.plan.buffers) is None
    xb = torch.randn(3, 64, 48, dtype=torch.float16)
    wb = torch.randn(3, 48, 72, dtype=torch.float16)
    c = eqfuse.compile(lambda a, b: torch.relu(a @ b), (xb, wb), autotune=False)
    (k,) = c.kernels
    assert k.schedule.batch and not templates.eligible(k.schedule)


def test_a_kernel_with_two_outputs_keeps_the_triton_kernel():
    def both(x, w, b):
        h = x @ w + b
        return h, F.gelu(h)
    inputs = make_inputs("gelu_bias", 64, 72, 48)
    c = eqfuse.compile(both, tuple(inputs), autotune=False)
    (k,) = [k for k in c.kernels if k.schedule.kind == "matmul"]
    assert len(k.spec.roots) == 2 and templates.form(k.spec, k.schedule, c.plan.buffers) is None


def test_the_epilogue_refuses_operators_gluon_lacks_and_values_of_the_k_loop():
    assert templates._in_gluon(["t1 = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1)"], "acc1", set()) is None
    assert templates._in_gluon(["t1 = (acc1 + v0)"], "acc1", set()) is None  # v0: not the epilogue's
    lines, args = templates._in_gluon(["v2 = tl.load(in2 + nindex, mask=nmask, other=0).to(tl.float32)",
                                      "t3 = tl.sigmoid(acc1 + v2)", "return t3"], "acc1", {"in2", "in0"})
    assert args == ["in2"]
    assert lines[0] == "v2 = gl.load(in2 + nindex, mask=nmask, other=0).to(gl.float32)"
    assert lines[1] == "t3 = pingpong_sigmoid(acc1 + v2)"


def test_offered_on_a_hopper_gpu_unless_switched_off(monkeypatch):
    _, k, _ = matmul_kernel("gelu_bias")
    monkeypatch.setattr(flash, "device_supports", lambda: True)
    monkeypatch.delenv("EQFUSE_PINGPONG", raising=False)
    pp, pp8, coop, coop4 = templates.candidates(k.schedule)
    assert pp["TEMPLATE"] == "pingpong" and pp["PROGRAMS"] == 1  # one 128 x 128 tile
    # gelu's erf: its epilogue in chunks of 16 rows, or 8 (half the code)
    assert (pp["CHUNK"], pp8) == (16, {**pp, "CHUNK": 8})
    assert coop["TEMPLATE"] == "cooperative" and (coop["BLOCK_M"], coop["BLOCK_N"]) == (128, 256)
    # gelu's erf: also four epilogue warps, the ring filled by an MMA warpgroup
    assert (coop["LOADER"], coop4) == (1, {**coop, "LOADER": 0})
    _, light, _ = matmul_kernel("relu_scaled")
    light_pp, light_coop = templates.candidates(light.schedule)
    assert (light_pp.get("CHUNK"), light_coop["LOADER"]) == (None, 1)  # stored by TMA, unchunked
    assert not templates.runnable({**light_pp, "CHUNK": 16}, light.schedule)
    for cfg in (pp, pp8, coop):
        assert templates.runnable(cfg, k.schedule) and not templates.runnable({**cfg, "BLOCK_N": 64}, k.schedule)
    unchunked = {key: v for key, v in pp.items() if key != "CHUNK"}  # a cached config from before CHUNK was one
    assert not templates.runnable(unchunked, k.schedule) and not templates.runnable({**pp, "CHUNK": 4}, k.schedule)
    assert templates.runnable(coop4, k.schedule) and not templates.runnable({**coop, "LOADER": 2}, k.schedule)
    from eqfuse.codegen.configs import fits
    stale = {"PINGPONG": 1, **{key: v for key, v in pp.items() if key != "TEMPLATE"}}  # an earlier cache's spelling
    assert fits(k.schedule, pp) and not fits(k.schedule, stale)
    unrounded = dataclasses.replace(k.schedule, rounded=False)  # the product not in the operands' dtype
    assert {c["TEMPLATE"] for c in templates.candidates(unrounded)} == {"pingpong"}
    assert not templates.runnable(coop, unrounded)
    monkeypatch.setenv("EQFUSE_PINGPONG", "0")  # off: neither offered nor taken from a cache
    assert templates.candidates(k.schedule) == [] and not templates.runnable(pp, k.schedule)


@pytest.mark.parametrize("name,first", [("gelu_bias", True), ("silu_linear", True), ("relu_scaled", False),
                                        ("linear_residual", False)])
def test_an_untuned_build_takes_the_template_first_for_a_special_function(monkeypatch, name, first):
    from eqfuse.codegen.configs import fallback_candidates, tuning_candidates
    _, k, _ = matmul_kernel(name)
    monkeypatch.setattr(flash, "device_supports", lambda: True)
    assert (fallback_candidates(k.schedule)[0].get("TEMPLATE") == "pingpong") == first
    tuned = {c.get("TEMPLATE") for c in tuning_candidates(k.schedule)}
    assert {"pingpong", "cooperative"} <= tuned  # the autotuner times both anyway
    monkeypatch.setenv("EQFUSE_PINGPONG", "0")
    assert not any(c.get("TEMPLATE") for c in fallback_candidates(k.schedule))


@pytest.mark.parametrize("m,n,first", [(8192, 4096, "cooperative"), (8192, 2304, None), (8192, 768, None)])
def test_an_untuned_build_takes_the_cooperative_template_first_for_a_light_epilogue_over_many_tiles(
        monkeypatch, m, n, first):
    """At least WAVES 128 x 256 tiles an SM (132 SMs: 8192 x 4096 has 7.8; GPT-2's q/k/v
    projection 4.4, its MLP output 1.5): the Triton kernels first otherwise."""
    from eqfuse.codegen import tma
    from eqfuse.codegen.configs import fallback_candidates
    monkeypatch.setattr(flash, "device_supports", lambda: True)
    monkeypatch.setattr(tma, "sm_count", lambda: 132)
    _, k, _ = matmul_kernel("relu_scaled")
    big = dataclasses.replace(k.schedule, m=m, n=n)
    assert fallback_candidates(big)[0].get("TEMPLATE") == first
    if first:
        assert fallback_candidates(big)[0]["LOADER"] == 1  # a loader warp beside two epilogue warps
        assert fallback_candidates(dataclasses.replace(big, rounded=False))[0].get("TEMPLATE") is None


def test_a_stored_config_the_build_refuses_is_timed_again(tmp_path, monkeypatch):
    """An autotuning store from before the ping-pong epilogue's CHUNK was a config key holds
    its config without it: the kernel is timed again (it is pending), not run as the
    default Triton kernel in the template's place."""
    from eqfuse.runtime import autotune
    monkeypatch.setenv("EQFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a Hopper GPU")
    compiled, k, _ = matmul_kernel("gelu_bias")
    monkeypatch.setattr(flash, "device_supports", lambda: True)
    _, infos = generate_module(compiled.plan, "gelu_bias", "test")

    def stored():
        chosen, pending = autotune._stored(compiled.plan, infos, "test")
        return chosen.get(k.name), {i.name: key for i, key in pending}
    _, pending = stored()
    pp = templates.candidates(k.schedule)[0]
    autotune._save(pending[k.name], {key: v for key, v in pp.items() if key != "CHUNK"})
    assert stored()[0] is None and k.name in stored()[1]
    autotune._save(pending[k.name], pp)
    assert stored()[0] == pp and k.name not in stored()[1]


def test_no_candidate_without_a_hopper_gpu(monkeypatch):
    _, k, _ = matmul_kernel("relu_scaled")
    monkeypatch.setattr(flash, "device_supports", lambda: False)
    assert templates.candidates(k.schedule) == []


def template_module(monkeypatch, name, m=64, n=72, k=48, dtype=torch.float16, device=DEVICE,
                    template="pingpong", loader=None, chunk=None):
    """The module with the kernel as a template, as a Hopper GPU's autotuner would make it
    (the cooperative one's ring filled by a loader warp or not, where ``loader`` says; the
    ping-pong one's chunk of rows, where ``chunk`` does)."""
    inputs = make_inputs(name, m, n, k, dtype, device)
    compiled = eqfuse.compile(FNS[name], tuple(inputs), autotune=False)
    (kernel,) = [k for k in compiled.kernels if k.schedule.kind == "matmul"]
    monkeypatch.setattr(flash, "device_supports", lambda: True)
    cfg = next(c for c in templates.candidates(kernel.schedule) if c["TEMPLATE"] == template)
    if loader is not None:
        cfg = {**cfg, "LOADER": loader}
    if chunk is not None:
        cfg = {**cfg, "CHUNK": chunk}
    source, infos = generate_module(compiled.plan, name, "test", {kernel.name: cfg})
    (info,) = [i for i in infos if i.name == kernel.name]
    return compiled, info, source, inputs


def test_the_module_launches_the_template_with_the_triton_kernel_for_unaligned_addresses(monkeypatch):
    compiled, info, source, _ = template_module(monkeypatch, "linear_residual", m=100, n=200, k=64)
    assert "from eqfuse.codegen.matmul_hopper import matmul_pingpong" in source
    assert f"def {info.name}_epilogue(" in source
    c = info.constexprs
    assert (c["M"], c["N"], c["K"], c["SA"], c["SB"], c["SC"], c["B_KMAJOR"]) == (100, 200, 64, 64, 64, 200, True)
    assert info.launch == {"num_warps": 4, "maxnreg": 168} and info.grid == (c["PROGRAMS"], 1)
    assert info.template == "the Hopper ping-pong matmul template"
    assert info.fallback is not None and info.fallback.params == info.params
    assert "TEMPLATE" not in info.fallback.constexprs and f"{info.name}_unaligned_launch" in source


def test_the_cooperative_template_shares_a_tile_between_two_warpgroups(monkeypatch):
    compiled, info, source, _ = template_module(monkeypatch, "gelu_bias", m=300, n=600, k=64,
                                                template="cooperative")
    assert "from eqfuse.codegen.matmul_hopper import matmul_cooperative" in source
    c = info.constexprs
    assert (c["BLOCK_M"], c["BLOCK_N"], c["STAGES"], c["LOADER"]) == (64, 256, 3, 1)  # 64 rows a warpgroup
    assert c["PROGRAMS"] == 3 * 3 and "CHUNK" not in c  # 128 x 256 tiles; its epilogue always chunked
    assert info.launch == {"num_warps": 4, "maxnreg": 168} and info.grid == (9, 1)
    assert info.template == "the Hopper cooperative matmul template"
    assert info.fallback.config["BLOCK_M"] == 128 and info.fallback.config["BLOCK_N"] == 256


@pytest.mark.parametrize("name,chunk", [("gelu_bias", 16), ("silu_linear", 16), ("linear_residual", 0)])
def test_an_epilogue_with_a_special_function_runs_in_chunks_of_rows(monkeypatch, name, chunk):
    """Its code once per chunk, not twice per tile (two copies of erf's overflowed the
    instruction cache); a light epilogue stays in registers and is stored by TMA."""
    _, info, _, _ = template_module(monkeypatch, name)
    assert info.constexprs["CHUNK"] == chunk
    if chunk:  # the autotuner's other chunk
        _, info, _, _ = template_module(monkeypatch, name, chunk=8)
        assert info.constexprs["CHUNK"] == 8


def test_a_sized_module_keeps_the_triton_kernel(monkeypatch):
    from eqfuse.codegen.kernel import generate_kernel
    compiled, info, _, _ = template_module(monkeypatch, "gelu_bias")
    g = generate_kernel(info.spec, compiled.plan.buffers, info.config, runtime=frozenset({"M"}))
    assert g.constexprs is None and "@triton.jit" in g.text and "TEMPLATE" not in g.cfg


def test_the_compile_worker_loads_the_template_module():
    line = "from eqfuse.codegen.matmul_hopper import matmul_pingpong"
    assert _stubbed(line) == "matmul_pingpong = _eqfuse_template('eqfuse.codegen.matmul_hopper').matmul_pingpong"
    assert _template("eqfuse.codegen.matmul_hopper").matmul_pingpong.is_gluon()
    line = "from eqfuse.codegen.matmul_hopper import sigmoid as pingpong_sigmoid"
    assert _stubbed(line).startswith("pingpong_sigmoid = _eqfuse_template(")


COMPILE_FOR_SM90 = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from eqfuse.runtime import cache
from eqfuse.runtime.compile_worker import ast_source, load_kernels

out = []
for source, name, params, constexprs in json.loads(sys.stdin.read()):
    src = "import triton\\nimport triton.language as tl\\n" + source
    fn = getattr(cache.load_module(cache.cache_key(src), src, False), name)
    sig = {p: "*fp16" if p in params else "constexpr" for p in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.arg_names) if p in params}
    # the key a compile worker that has loaded nothing yet files it under
    sys.modules.pop("eqfuse_compile_worker_matmul_hopper", None)
    twin = getattr(load_kernels(fn.fn.__code__.co_filename, {}), name)
    same_key = ast_source(twin, sig, constexprs, attrs).hash() == ast_source(fn, sig, constexprs, attrs).hash()
    k = triton.compile(ast_source(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "maxnreg": 168})
    ptx = k.asm["ptx"]
    out.append({"shared": k.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"),
                "setmaxnreg": "setmaxnreg" in ptx, "tma": "cp.async.bulk.tensor" in ptx, "same_key": same_key})
print(json.dumps(out))
"""


def test_the_template_compiles_for_sm90_without_a_gpu(monkeypatch):
    """Triton's compiler and its bundled ptxas need no GPU: the template around each
    epilogue builds for Hopper, its products on wgmma, registers handed from the loader to
    the consumers, shared memory under the H100's 227 KB; a compile worker keys each as the
    JIT does (in a child process: one that interprets Triton kernels cannot compile them)."""
    jobs = []
    for name, template, loader in [("gelu_bias", "pingpong", None), ("linear_residual", "pingpong", None),
                                   ("silu_linear", "pingpong", None), ("gelu_bias", "cooperative", 0),
                                   ("linear_residual", "cooperative", 1)]:
        _, info, _, _ = template_module(monkeypatch, name, m=256, n=256, k=128, template=template, loader=loader)
        assert template in info.template.replace("-", "")
        jobs.append((info.source, info.name, info.params, info.constexprs))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(eqfuse.__file__)),
                                                    env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], input=json.dumps(jobs), capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kernel in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert kernel["shared"] <= 232448 and kernel["wgmma"] >= 2 and kernel["setmaxnreg"] and kernel["tma"]
        assert kernel["same_key"]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the template needs a Hopper GPU (sm_90a)")
@pytest.mark.parametrize("m,n,k", [(17, 72, 64), (100, 200, 64), (300, 264, 200), (1024, 768, 768)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name,template,loader,chunk", [
    (name, template, loader, chunk) for name in FNS
    for template, loader, chunk in [("pingpong", None, None), ("pingpong", None, 8), ("cooperative", 0, None),
                                    ("cooperative", 1, None)]
    if chunk is None or name in SPECIAL])
def test_template_matches_eager(monkeypatch, name, m, n, k, dtype, template, loader, chunk):
    compiled, info, source, inputs = template_module(monkeypatch, name, m, n, k, dtype, "cuda", template, loader,
                                                     chunk)
    assert template in info.template.replace("-", "")
    module = cache.load_module(cache.cache_key(source, "cuda"), source, interpret=False)
    got = module.call(inputs[0].device, [], *inputs)[0]
    assert_matches(got, FNS[name](*inputs), contraction=True)
