"""The nounroll mark on products' K loops (eqfuse/runtime/ptx_loops.py): which loops of a
PTX text it marks, which modules' PTX it touches, and, compiled for an H100 without a GPU
(Triton bundles ptxas and cuobjdump) in a child process as in test_parallel_compile.py,
that ptxas then keeps a loop it had unrolled 32 times, in the compile pool and in this
process's JIT alike, while a kernel of another module is compiled as before."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import eqfuse
from eqfuse.runtime import ptx_loops


def ptx(body: str, bound: str = "1984", file: str = "/cache/eqfuse_0123abcd.py") -> str:
    """A kernel's PTX as LLVM prints it: one loop, ``body`` in it, counting to ``bound``."""
    return f"""
.visible .entry k0_mm(
)
{{
	mov.b32 	%r1, 0;
$L__BB0_1:                              // =>This Inner Loop Header: Depth=1
	add.s64 	%rd81, %rd81, 64;
{body}
	setp.lt.u64 	%p5, %rd81, {bound};
	@%p5 bra 	$L__BB0_1;
	ret;
}}
	.file	1 "{file}"
"""


WGMMA = "\twgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%r1}, %rd44, %rd45, %p1, 1, 1, 0, 1;"
EXP = "\tex2.approx.f32 %f2, %f1;"


def test_a_counted_product_loop_is_marked_once():
    text = ptx(WGMMA)
    marked = ptx_loops.nounroll_products(text)
    assert marked.count('.pragma "nounroll";') == 1
    header = marked.splitlines().index(next(ln for ln in marked.splitlines() if ln.startswith("$L__BB0_1:")))
    assert marked.splitlines()[header + 1] == ptx_loops.PRAGMA  # in the loop's header block
    assert marked.replace(ptx_loops.PRAGMA + "\n", "") == text  # and nothing else changes


@pytest.mark.parametrize("body, bound, why", [
    ("\tadd.f32 %f1, %f1, %f2;", "1984", "no product in the loop"),
    (WGMMA + "\n" + EXP, "1984", "an attention kernel's key loop (exponentials)"),
    (WGMMA, "%rd9", "a trip count known only at run time"),
])
def test_other_loops_are_left_to_ptxas(body, bound, why):
    text = ptx(body, bound)
    assert ptx_loops.nounroll_products(text) == text, why


def test_only_modules_eqfuse_wrote_are_touched(monkeypatch):
    assert ptx_loops._generated(ptx(WGMMA))
    assert ptx_loops._generated(ptx(WGMMA, file='/cache" "eqfuse_0123abcd.py'))  # directory, name apart
    assert not ptx_loops._generated(ptx(WGMMA, file="/home/user/my_kernels.py"))
    monkeypatch.setattr(ptx_loops, "_also", {"/out/kernels.py"})  # an export's module, named to install
    assert ptx_loops._generated(ptx(WGMMA, file="/out/kernels.py"))


CHILD = r"""
import glob, json, os, subprocess, sys, importlib.util
import torch, triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from eqfuse.runtime import parallel_compile as pc, ptx_loops

TARGET = ("cuda", 90, 32)

def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return next(v for k, v in vars(module).items() if k.endswith("_launch"))

def hgmma(cache):
    sass = "".join(subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", c], capture_output=True, text=True).stdout
                   for c in glob.glob(os.path.join(cache, "**", "*.cubin"), recursive=True))
    return sass.count("HGMMA")

def marked(cache):
    return any('.pragma "nounroll"' in open(p).read()
               for p in glob.glob(os.path.join(cache, "**", "*.ptx"), recursive=True))

ptx_loops.install()  # as runtime/cache.py's load_module does before the first launch
out = {}
eqfuse_path, user_path, pool_cache, jit_cache, user_cache = sys.argv[1:6]
for label, path, cache in (("jit", eqfuse_path, jit_cache), ("user", user_path, user_cache)):
    launcher = load(path, label)
    args = [pc.Pointer(torch.float16)] * (len(launcher.fn.arg_names) - len(launcher.constexprs))
    job = pc.specialisation(launcher, args, TARGET)
    knobs.cache.dir = cache
    triton.compile(ASTSource(launcher.fn, job.signature, job.constexprs, job.attrs),
                   target=GPUTarget(*TARGET), options=job.options)
    out[label] = {"hgmma": hgmma(cache), "marked": marked(cache)}
knobs.cache.dir = pool_cache
launcher = load(eqfuse_path, "pooled")
args = [pc.Pointer(torch.float16)] * (len(launcher.fn.arg_names) - len(launcher.constexprs))
outcome = pc.precompile([(launcher, args)], TARGET).as_dict()
out["pool"] = {"hgmma": hgmma(pool_cache), "marked": marked(pool_cache), "outcome": outcome}
pc.shutdown()
print(json.dumps(out))
"""


def test_ptxas_keeps_the_k_loop_in_the_pool_and_the_jit(tmp_path):
    """The product ptxas unrolled whole on an H100 host (BERT's weight gradient's shape:
    [768 x 2048] @ [2048 x 768], 128 x 128 x 64 tiles on 8 warps, 32 K steps): marked, its
    SASS holds one K step's HGMMA instructions; in another module, all 32 steps'."""
    a, b = torch.randn(768, 2048, dtype=torch.float16), torch.randn(2048, 768, dtype=torch.float16)
    source = eqfuse.compile(lambda a, b: a @ b, (a, b)).source
    launch = re.search(r"k0_mm_launch = KernelLauncher\(k0_mm, \(\d+, 1\), \{[^}]*\}, "
                       r"num_warps=\d+, num_stages=\d+", source)
    assert launch, source[-800:]  # the CPU plan's tiles, replaced by the H100's
    tiles = "'M': 768, 'N': 768, 'K': 2048, 'BLOCK_M': 128, 'BLOCK_N': 128, 'BLOCK_K': 64, 'GROUP_M': 8"
    source = source.replace(launch.group(0),
                            f"k0_mm_launch = KernelLauncher(k0_mm, (36, 1), {{{tiles}}}, num_warps=8, num_stages=3")
    eqfuse_path, user_path = tmp_path / "eqfuse_nounrolltest.py", tmp_path / "user_kernels.py"
    eqfuse_path.write_text(source)
    user_path.write_text(source)
    caches = [str(tmp_path / name) for name in ("pool", "jit", "user")]
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    env["EQFUSE_COMPILE_WORKERS"] = "2"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(eqfuse_path), str(user_path), *caches],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["pool"]["outcome"]["compiled_in_pool"] == 1, out
    for where in ("pool", "jit"):
        assert out[where]["marked"], where
        assert out[where]["hgmma"] == 4, out  # one K step: two warp groups x two halves of BLOCK_K
    assert not out["user"]["marked"]
    assert out["user"]["hgmma"] == 4 * 32, out  # ptxas's own choice for this loop: all 32 steps
