"""Parallel kernel compilation (eqfuse/runtime/parallel_compile.py) without a GPU: the
option and its switch, the pieces that decide what the JIT would compile, and the pool
itself, which compiles for an NVIDIA target on any host (Triton bundles ptxas). The pool
runs in a child process with Triton's interpreter off, as triton_aot's tests do: a process
whose Triton interprets cannot compile. On a GPU, tests/test_gpu.py checks that the first
launches find every kernel compiled."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_matches

import eqfuse
import eqfuse.backend
from eqfuse.runtime import parallel_compile as pc
from eqfuse.runtime.launch import KernelLauncher


def rmsnorm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def test_option_defaults_on_and_is_declared():
    assert eqfuse.Options().parallel_compile is True
    assert eqfuse.Options.make(parallel_compile=False).parallel_compile is False
    with pytest.raises(TypeError, match="parallel_compile"):  # the known options are listed
        eqfuse.Options.make(parallel_compiles=False)


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("1", True), (None, True)])
def test_environment_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(pc.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(pc.ENV_SWITCH, value)
    assert pc.enabled(True) is on
    assert pc.enabled(False) is False


def test_worker_count_follows_the_environment(monkeypatch):
    monkeypatch.setenv(pc.ENV_WORKERS, "3")
    assert pc.worker_count() == 3
    monkeypatch.delenv(pc.ENV_WORKERS)
    assert 1 <= pc.worker_count() <= pc.MAX_WORKERS


def test_backend_passes_the_option_on():
    x, w = torch.randn(4, 33), torch.rand(33)
    eqfuse.backend.history.clear()
    torch._dynamo.reset()
    compiled = torch.compile(rmsnorm, backend="eqfuse", options={"parallel_compile": False})
    assert_matches(compiled(x, w), rmsnorm(x, w))
    assert eqfuse.backend.history[-1].options.parallel_compile is False
    torch._dynamo.reset()


def test_off_on_the_cpu(monkeypatch):
    def no_pool():
        raise AssertionError("the pool was asked for")
    monkeypatch.setattr(pc, "pool", no_pool)
    x, w = torch.randn(4, 35, device="cpu"), torch.rand(35, device="cpu")
    compiled = eqfuse.compile(rmsnorm, (x, w))
    assert_matches(compiled(x, w), rmsnorm(x, w))
    assert "compile" not in compiled.report and "internal error" not in compiled.report.get("note", "")
    assert "compile" not in compiled.report["seconds"]


def test_resolve_picks_the_twin_without_tma_for_an_unaligned_address():
    plain = KernelLauncher(object(), (1,), {})
    tma = KernelLauncher(object(), (1,), {}, aligned=0b10, otherwise=plain)  # the first of two tensors
    f16 = torch.float16
    assert tma.resolve([pc.Pointer(f16), pc.Pointer(f16, aligned=False)])[0] is tma
    assert tma.resolve([pc.Pointer(f16, aligned=False), pc.Pointer(f16)])[0] is plain


def test_resolve_hands_the_twin_the_arguments_it_takes():
    """A template whose q, k and v share a buffer: its portable twin takes that buffer once."""
    plain = KernelLauncher(object(), (1,), {})
    flash = KernelLauncher(object(), (1,), {}, aligned=0b1111, otherwise=plain, picks=(0, 3))
    qkv, out = pc.Pointer(torch.float16, aligned=False), pc.Pointer(torch.float16)
    launcher, args = flash.resolve([qkv, qkv, qkv, out])
    assert launcher is plain and args == (qkv, out)


def test_module_launches_take_the_alignment_of_the_inputs():
    base = torch.randn(8 * 40 + 1)
    x, w = base[1:].view(8, 40), torch.rand(40)  # x starts 4 bytes into its storage
    compiled = eqfuse.compile(rmsnorm, (x, w))
    v = compiled._main
    launches = pc.module_launches(v.module, v.kernels, v.plan, [x, w])
    assert len(launches) == len(v.kernels) >= 1
    by_name = {b.name: t for b, t in zip(v.plan.inputs, (x, w))}
    for (launcher, args), info in zip(launches, v.kernels):
        assert launcher is getattr(v.module, f"{info.name}_launch")
        for p, a in zip(info.params, args):
            assert a.dtype == torch.float32
            assert a.aligned is (by_name.get(p) is not x)  # buffers eqfuse allocates are aligned


CHILD = r"""
import json, os, sys, importlib.util, torch
from triton import knobs
from eqfuse.runtime import parallel_compile as pc

TARGET = ("cuda", 90, 32)

# Triton's own key, computed by a child process (prestart starts it) and taken here: the
# same value this process's Triton computes.
from triton.runtime import cache
own = cache.triton_key
pc.ready_triton_ahead()
where, key = pc._triton_key()
taken = cache.triton_key is not own and where in own.__wrapped__.__code__.co_filename
out = {"triton_key_from_the_child": taken and key == own()}
# and another child builds the driver's C module into this process's Triton cache (here,
# without libcuda, it fails quietly; tests/test_gpu.py checks the module it builds)
out["driver_child_cache"] = pc._driver_child.args[-1] == knobs.cache.dir
out["driver_child_ends"] = pc._driver_child.wait(60) is not None
spec = importlib.util.spec_from_file_location("generated", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
launcher = next(v for k, v in vars(module).items() if k.endswith("_launch"))
n = len(launcher.fn.arg_names) - len(launcher.constexprs)
aligned = [pc.Pointer(torch.float16)] * n
shifted = [pc.Pointer(torch.float16, aligned=False)] + aligned[1:]
out["first"] = pc.precompile([(launcher, aligned)], TARGET).as_dict()
out["again"] = pc.precompile([(launcher, aligned), (launcher, aligned)], TARGET).as_dict()
out["shifted"] = pc.precompile([(launcher, shifted)], TARGET).as_dict()

# What the JIT does at the first launch (JITFunction._do_compile): triton.compile with the
# specialisation it reads; the pool's work must make it a cache hit.
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
hits = []
knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
for args in (aligned, shifted):
    job = pc.specialisation(launcher, args, TARGET)
    triton.compile(ASTSource(launcher.fn, job.signature, job.constexprs, job.attrs),
                   target=GPUTarget(*TARGET), options=job.options)
out["jit_cache_hits"] = list(hits)
out["attrs"] = [str(pc.specialisation(launcher, a, TARGET).attrs) for a in (aligned, shifted)]

# Inductor sets TRITON_PTXAS_PATH to torch's ptxas at its first compile, after this
# process's Triton has keyed kernels by the version of its own (read once, cached): here a
# stand-in of another version. Workers already running and workers started after it (the
# models benchmark runs torch.compile, then eqfuse) must key as this process does, and run
# the ptxas it names now.
from triton.backends.nvidia import compiler as nvidia
out["version_cached_before"] = nvidia.get_ptxas_version.cache_info().currsize > 0
os.environ["TRITON_PTXAS_PATH"] = sys.argv[3]
knobs.cache.dir = sys.argv[5]
out["ptxas_set_while_running"] = pc.precompile([(launcher, aligned)], TARGET).as_dict()
out["standin_runs_while_running"] = len(open(sys.argv[4]).read().splitlines())
pc.shutdown()
knobs.cache.dir = sys.argv[6]
out["ptxas_set_before_start"] = pc.precompile([(launcher, shifted)], TARGET).as_dict()
hits.clear()
job = pc.specialisation(launcher, shifted, TARGET)  # the JIT, keying by the version it read first
triton.compile(ASTSource(launcher.fn, job.signature, job.constexprs, job.attrs),
               target=GPUTarget(*TARGET), options=job.options)
out["jit_cache_hits_after_ptxas_changed"] = hits
knobs.compilation.listener = None

# Triton's own key comes with the job (a worker need not hash Triton's files), where the
# worker's Triton is the same install: a stand-in key is taken, so the kernel is filed
# under another key than the JIT's; from another install's path, it is not.
real_key = pc._triton_key()
pc._triton_key = lambda: (real_key[0], "a stand-in key")
knobs.cache.dir = sys.argv[8]
out["stand_in_triton_key"] = pc.precompile([(launcher, aligned)], TARGET).as_dict()
pc._triton_key = lambda: ("/another/triton", "a stand-in key")
knobs.cache.dir = sys.argv[9]
out["stand_in_triton_key_elsewhere"] = pc.precompile([(launcher, aligned)], TARGET).as_dict()
pc._triton_key = lambda: real_key

# The C launcher is built on a thread while the kernel compiles, from the source the
# compiled kernel would give it (Triton writes it from the signature and the constants).
import threading
from dataclasses import asdict
from triton.backends.nvidia.driver import make_launcher
from eqfuse.runtime import compile_worker

def launcher_source(k):
    index = lambda x: (k.src.fn.arg_names.index(x),) if isinstance(x, str) else x
    return make_launcher({index(i): v for i, v in k.src.constants.items()}, dict(k.src.signature),
                         getattr(k.metadata, "tensordesc_meta", None))

built = []
compile_worker._build_launcher = lambda k: built.append(
    (threading.current_thread() is threading.main_thread(), launcher_source(k))) or ""
knobs.cache.dir = sys.argv[10]
job = pc.specialisation(launcher, aligned, TARGET)
reply = compile_worker.compile_job(asdict(job), {})
kernel = triton.compile(ASTSource(launcher.fn, job.signature, job.constexprs, job.attrs),
                        target=GPUTarget(*TARGET), options=job.options)
out["launcher_ahead"] = {"hash_as_the_jit": reply["hash"] == job.hash, "on_main_thread": [b[0] for b in built],
                         "same_source": [b[1] == launcher_source(kernel) for b in built]}

# A worker that keys otherwise all the same: the report names the part of the key.
knobs.cache.dir = sys.argv[7]
pc._ptxas = lambda target: ("Cuda compilation tools, release 0.0, V0.0.0", nvidia.get_ptxas(90).path)
out["other_key"] = pc.precompile([(launcher, aligned)], TARGET).as_dict()

# A pool whose workers cannot start: a note, no exception, nothing compiled.
pc.shutdown()
dead = "import sys; print('no compiler here', file=sys.stderr); sys.exit(3)"
pc._worker_command = lambda: [sys.executable, "-c", dead]
knobs.cache.dir = sys.argv[2]
out["broken"] = pc.precompile([(launcher, aligned)], TARGET).as_dict()
out["still_broken"] = pc.precompile([(launcher, aligned)], TARGET).as_dict()
pc.shutdown()
print(json.dumps(out))
"""


def _standin_ptxas(tmp):
    """A ptxas that runs Triton's, says it is another version (as torch's ptxas does), and
    logs the compiles it runs."""
    from triton import knobs
    real, log, path = knobs.nvidia.ptxas.path, tmp / "standin.log", tmp / "ptxas"
    log.write_text("")
    path.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then "{real}" --version | sed 's/V[0-9.]*/&-standin/'; exit; fi
echo "$@" >> "{log}"
exec "{real}" "$@"
""")
    path.chmod(0o755)
    return str(path), str(log)


@pytest.fixture(scope="module")
def child_run(tmp_path_factory):
    """The scenarios of CHILD, run once in a process that compiles (see the module's doc)."""
    tmp = tmp_path_factory.mktemp("parallel_compile")
    x, w = torch.randn(16, 100, dtype=torch.float16), torch.rand(100, dtype=torch.float16)
    source = eqfuse.compile(rmsnorm, (x, w)).source
    path = tmp / "generated.py"
    path.write_text(source)
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="", TRITON_CACHE_DIR=str(tmp / "triton"))
    env[pc.ENV_WORKERS] = "2"
    env.pop(pc.ENV_SWITCH, None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    standin, log = _standin_ptxas(tmp)
    caches = [str(tmp / name) for name in ("triton-empty", "triton-2", "triton-3", "triton-4", "triton-5",
                                           "triton-6", "triton-7")]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), caches[0], standin, log, *caches[1:]],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pool_compiles_into_tritons_cache(child_run):
    first = child_run["first"]
    assert (first["kernels"], first["cached"], first["compiled_in_pool"]) == (1, 0, 1), first
    assert first["workers"] == 2 and "failed" not in first and "note" not in first


def test_kernels_in_the_cache_are_not_sent_again(child_run):
    again = child_run["again"]  # the same launch twice: one kernel, found in the cache
    assert (again["kernels"], again["cached"], again["compiled_in_pool"]) == (1, 1, 0), again


def test_alignment_is_part_of_the_specialisation(child_run):
    aligned, shifted = child_run["attrs"]
    assert aligned != shifted and "tt.divisibility" in aligned
    assert child_run["shifted"]["compiled_in_pool"] == 1  # another binary, compiled too


def test_the_jits_compile_hits_what_the_pool_compiled(child_run):
    assert child_run["jit_cache_hits"] == [True, True]


def test_workers_key_by_the_ptxas_version_the_jit_read_first(child_run):
    """TRITON_PTXAS_PATH changed after this process's Triton read the version of its ptxas
    (Inductor does it): before the fix, every kernel a worker compiled was 'compiled under
    another key than the JIT's'."""
    assert child_run["version_cached_before"]
    for case in ("ptxas_set_while_running", "ptxas_set_before_start"):
        out = child_run[case]
        assert (out["kernels"], out["compiled_in_pool"]) == (1, 1) and "failed" not in out, (case, out)
    assert child_run["jit_cache_hits_after_ptxas_changed"] == [True]


def test_workers_run_the_ptxas_the_jit_would_run(child_run):
    # the workers were started before TRITON_PTXAS_PATH named the stand-in
    assert child_run["standin_runs_while_running"] >= 1


def test_tritons_own_key_is_computed_by_a_child_process(child_run):
    assert child_run["triton_key_from_the_child"] is True
    assert child_run["driver_child_cache"] is True and child_run["driver_child_ends"] is True


def test_workers_take_tritons_own_key_from_the_job(child_run):
    taken = child_run["stand_in_triton_key"]
    assert taken["compiled_in_pool"] == 0, taken
    (failure,) = taken["failed"]
    assert "(triton '" in failure and "backend '" not in failure, failure
    elsewhere = child_run["stand_in_triton_key_elsewhere"]  # another install's key: not taken
    assert elsewhere["compiled_in_pool"] == 1 and "failed" not in elsewhere, elsewhere


def test_the_launcher_is_built_beside_the_compile(child_run):
    ahead = child_run["launcher_ahead"]
    assert ahead == {"hash_as_the_jit": True, "on_main_thread": [False], "same_source": [True]}


def test_a_key_that_differs_is_explained(child_run):
    out = child_run["other_key"]
    assert out["compiled_in_pool"] == 0, out
    (failure,) = out["failed"]
    assert "compiled under another key than the JIT's (backend 'ptxas release 0.0, V0.0.0, 90' in the worker" in failure
    for part in ("source", "options", "environment", "triton"):
        assert f"{part} '" not in failure, failure  # only the part that differs


def test_a_pool_that_cannot_start_leaves_kernels_to_the_first_launch(child_run):
    for case in ("broken", "still_broken"):
        out = child_run[case]
        assert out["compiled_in_pool"] == 0 and out["cached"] == 0, out
        assert out["note"].startswith("compile pool failed, kernels compile serially at first launch"), out
    assert "no compiler here" in child_run["broken"]["note"]  # the worker's last words


def test_the_backend_starts_tritons_key_for_a_graph_on_the_gpu(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from eqfuse import backend
    started = []
    monkeypatch.setattr(pc, "ready_triton_ahead", lambda: started.append(True))
    monkeypatch.delenv(pc.ENV_SWITCH, raising=False)
    with FakeTensorMode():
        on_gpu = [torch.empty(2, device="cuda")]
    backend._ready_triton_ahead([torch.ones(2, device="cpu")], {})  # the CPU: no pool
    backend._ready_triton_ahead(on_gpu, {"parallel_compile": False})
    assert started == []
    backend._ready_triton_ahead(on_gpu, {})
    assert started == [True]


def test_a_key_child_that_fails_leaves_the_key_to_this_process(monkeypatch):
    import functools

    from triton.runtime import cache
    computed = cache.triton_key.__wrapped__
    fresh = functools.lru_cache(computed)  # this process has not computed it yet
    monkeypatch.setattr(cache, "triton_key", fresh)
    monkeypatch.setattr(pc, "_KEY_SCRIPT", "import sys; print('nonsense'); sys.exit(3)")
    monkeypatch.setattr(pc, "_DRIVER_SCRIPT", "pass")
    monkeypatch.setattr(pc, "_key_child", None)
    monkeypatch.setattr(pc, "_driver_child", None)
    monkeypatch.setenv(pc.ENV_WORKERS, "2")
    pc.ready_triton_ahead()
    assert pc._key_child is not None
    where, key = pc._triton_key()
    assert cache.triton_key is fresh and key == computed() and pc._key_child is None


def test_pending_makes_its_jobs_in_the_callers_thread(monkeypatch):
    """Made on the Pending thread beside validation, each kernel's specialisation waited for
    the GIL; made first by the caller, the jobs go out before the caller goes on."""
    import threading

    class Launch:
        def resolve(self, args):
            return self, args

        fn = None

    made_on = []

    def specialisation(launcher, args, target, backend):
        made_on.append(threading.current_thread() is threading.main_thread())
        return pc.Job("module.py", "k", {}, {}, {}, {}, target, {}, "", hash=str(len(made_on)))

    monkeypatch.setattr(pc, "current_target", lambda: ("cuda", 90, 32))
    monkeypatch.setattr(pc, "_backend", lambda target: None)
    monkeypatch.setattr(pc, "_triton_key", lambda: ("", "key"))
    monkeypatch.setattr(pc, "specialisation", specialisation)
    monkeypatch.setattr(pc, "is_cached", lambda job: True)  # nothing to send
    out = pc.Pending([(Launch(), []), (Launch(), [])]).wait()
    assert made_on == [True, True]
    assert (out.kernels, out.cached, out.compiled) == (2, 2, 0)


def test_autotune_store_keeps_a_configs_key_order(tmp_path, monkeypatch):
    """A kernel's constexpr parameters come in its config's order: a config read back in
    another order makes another source, which a later process compiles again."""
    from eqfuse.runtime import autotune
    monkeypatch.setenv("EQFUSE_CACHE_DIR", str(tmp_path))
    cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    autotune._save("a kernel", cfg)
    assert list(autotune._load_store()["a kernel"]) == list(cfg)


class _Template:
    """A Gluon kernel, as parallel_compile sees one (no source needed: jobs are faked)."""
    arg_names = ["x"]

    def is_gluon(self):
        return True


class _Portable:
    arg_names = ["x"]


def _template_and_plain(monkeypatch, pool_class):
    """A template launcher with its portable twin, and a plain launcher; the pool faked,
    each launcher's job named after it."""
    from eqfuse.runtime.launch import KernelLauncher

    twin = KernelLauncher(_Portable(), (1,), {})
    template = KernelLauncher(_Template(), (1,), {}, otherwise=twin)
    plain = KernelLauncher(_Portable(), (1,), {})
    names = {id(template): "template", id(twin): "twin", id(plain): "plain"}

    def specialisation(launcher, args, target, backend):
        name = names[id(launcher)]
        return pc.Job("module.py", name, {}, {}, {}, {}, target, {}, "", hash=name)

    monkeypatch.setattr(pc, "worker_count", lambda: 4)
    monkeypatch.setattr(pc, "pool", pool_class)
    monkeypatch.setattr(pc, "current_target", lambda: ("cuda", 90, 32))
    monkeypatch.setattr(pc, "_backend", lambda target: None)
    monkeypatch.setattr(pc, "_triton_key", lambda: ("", "key"))
    monkeypatch.setattr(pc, "_ptxas", lambda target: ("", ""))
    monkeypatch.setattr(pc, "specialisation", specialisation)
    monkeypatch.setattr(pc, "is_cached", lambda job: False)
    return template, plain


def test_a_slow_template_runs_its_twin_until_it_compiles(monkeypatch):
    """A template with a portable twin (the flash template) is not waited for: Pending's
    wait() returns once the other kernels (the twin among them) are compiled, the launcher
    runs the twin meanwhile, and the template from its reply on. The outcome lists it as
    compiling in the background until then, and counts it compiled after."""
    import threading

    release = threading.Event()
    sent = []

    class FakePool:
        size, broken = 4, ""

        def compile(self, jobs, on_reply):
            sent.extend(j.name for j in jobs)
            # As workers in parallel would: the template, sent first, replies last
            for i in sorted(range(len(jobs)), key=lambda i: jobs[i].name == "template"):
                if jobs[i].name == "template":
                    release.wait(10)
                on_reply(i, {"hash": jobs[i].hash, "seconds": 0.1})

    template, plain = _template_and_plain(monkeypatch, FakePool)
    pending = pc.Pending([(template, [torch.empty(1)]), (plain, [torch.empty(1)])])
    assert template.deferred and not plain.deferred
    out = pending.wait()
    # The slowest job is sent first, so that no worker is left idle waiting for it at the end
    assert sent[0] == "template" and sorted(sent) == ["plain", "template", "twin"]
    assert out.background == ["template: its portable twin runs until it compiles"] and template.deferred
    assert out.compiled == 2
    release.set()
    pending._thread.join(10)
    assert not template.deferred and out.background == []
    assert out.compiled == 3 and not out.failed


@pytest.mark.parametrize("error, deferred", [("pool gone", False), ("Triton refused it", True)])
def test_a_template_the_pool_did_not_compile(monkeypatch, error, deferred):
    """A pool that failed leaves the template to the JIT, as any kernel; one Triton
    refused keeps its twin (the JIT would refuse it too)."""
    class FakePool:
        size, broken = 4, "pool gone"

        def compile(self, jobs, on_reply):
            for i, job in enumerate(jobs):
                on_reply(i, {"error": error} if job.name == "template" else {"hash": job.hash, "seconds": 0.1})

    template, plain = _template_and_plain(monkeypatch, FakePool)
    pending = pc.Pending([(template, [torch.empty(1)]), (plain, [torch.empty(1)])])
    pending.wait()
    pending._thread.join(10)
    assert template.deferred is deferred


def test_without_a_pool_nothing_is_deferred(monkeypatch):
    template, _ = _template_and_plain(monkeypatch, None)
    monkeypatch.setattr(pc, "worker_count", lambda: 1)
    out = pc.Pending([(template, [torch.empty(1)])]).wait()
    assert not template.deferred and out.background == []
