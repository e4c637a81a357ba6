"""Ahead-of-time export (eqfuse/export.py), its loader (eqfuse/runtime/exported.py) and
`eqfuse inspect` (eqfuse/stages.py).

Triton compiles for an explicit GPU target without a GPU (its bundled ptxas makes the
cubin), so the CPU tests export real cubins for sm_90 and check the manifest, the grid
formulas and the loader's errors. The GPU tests run exported graphs in a fresh process
that never imports Triton, against eager."""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import assert_matches, sorted_along

import eqfuse
from eqfuse.examples import ALL_EXAMPLES
from eqfuse.export import ExportError, evaluate_grid_formula, export_graph
from eqfuse.runtime import load_exported
from eqfuse.runtime.exported import ExportedGraphError, Manifest
from eqfuse.runtime.triton_aot import AotCompileError, parse_arch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (example, sizes, dtype): a row reduction, a matmul with an epilogue, a batched matmul
CASES = {"rmsnorm": ((16, 200), torch.float16), "linear_gelu": ((32, 64, 48), torch.float16),
         "attention_scores": ((32, 32, 16), torch.float32)}


def _arch():
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return "sm_90"


def _compile(name):
    sizes, dtype = CASES[name]
    ex = ALL_EXAMPLES[name]
    torch.manual_seed(0)
    inputs = ex.make_inputs(*sizes, dtype, DEVICE)
    return eqfuse.compile(ex.fn, inputs, autotune=False), inputs


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (directory, manifest dict, inputs)"""
    out = {}
    for name in CASES:
        compiled, inputs = _compile(name)
        directory = tmp_path_factory.mktemp(name)
        path = export_graph(compiled, directory, arch=_arch())
        out[name] = (directory, json.loads(path.read_text()), inputs)
    return out


def test_manifest_format(exported):
    directory, m, inputs = exported["rmsnorm"]
    assert m["format"] == "eqfuse-export" and m["manifest_version"] == 1
    assert m["target"]["arch"] == parse_arch(_arch())
    assert [i["shape"] for i in m["inputs"]] == [list(x.shape) for x in inputs]
    assert [i["dtype"] for i in m["inputs"]] == ["float16", "float16"]
    assert [i["strides"] for i in m["inputs"]] == [list(x.stride()) for x in inputs]
    (k,) = m["kernels"]
    cubin = (directory / k["cubin"]).read_bytes()
    assert cubin[:4] == b"\x7fELF"
    ptx = (directory / k["ptx"]).read_text()
    assert f".entry {k['entry']}(" in ptx and f".target {m['target']['sm']}" in ptx
    # every parameter of the PTX entry is in the manifest, in order: buffers, then Triton's two scratch pointers
    entry_params = ptx.split(f".entry {k['entry']}(")[1].split(")")[0].count(".param")
    assert len(k["params"]) == entry_params
    assert [p["name"] for p in k["params"][-2:]] == ["global_scratch", "profile_scratch"]
    assert all(p["type"] == "*fp16" for p in k["params"][:-2])
    assert k["block"] == [32 * k["num_warps"], 1, 1] and k["reqntid"] == [32 * k["num_warps"]]
    assert k["resources"]["registers"] > 0
    # the buffer plan: every buffer a kernel names is an input or allocated, and the output is one of them
    allocated = {b["name"] for b in m["buffers"]}
    names = allocated | {i["name"] for i in m["inputs"]} | {c["name"] for c in m["constants"]}
    assert all(p["buffer"] in names for p in k["params"] if "buffer" in p)
    assert m["outputs"] == [{"kind": "buffer", "buffer": k["params"][2]["buffer"]}]
    assert k["params"][2]["buffer"] in allocated
    assert (directory / "kernels.py").read_text().count("@triton.jit") == 1


@pytest.mark.parametrize("name, expected", [("rmsnorm", ["cdiv(R, BLOCK_R)"]),
                                            ("linear_gelu", ["cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)", "1"]),
                                            ("attention_scores", ["cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)", "B0 * B1"])])
def test_grid_formula(exported, name, expected):
    _, m, _ = exported[name]
    (k,) = m["kernels"]
    if k["grid_formula"] == ["PROGRAMS", "1"]:  # a GPU's persistent matmul: its programs walk every tile
        assert name == "linear_gelu" and k["grid"] == [k["grid_sizes"]["PROGRAMS"], 1, 1]
        assert evaluate_grid_formula(k["grid_formula"], dict(k["grid_sizes"], M=1000, N=7))[0] == k["grid"][0]
        return
    assert k["grid_formula"] == expected
    grid = evaluate_grid_formula(k["grid_formula"], k["grid_sizes"])
    assert list(grid) + [1] * (3 - len(grid)) == k["grid"]
    # a formula, not a constant: other sizes give the grid they would need
    sizes = dict(k["grid_sizes"], **({"R": k["grid_sizes"]["R"] * 3 + 1} if "R" in k["grid_sizes"] else
                                     {"M": 1000, "N": 7}))
    if "R" in sizes:
        assert evaluate_grid_formula(k["grid_formula"], sizes)[0] == -(-sizes["R"] // sizes["BLOCK_R"])
    else:
        bm, bn = sizes["BLOCK_M"], sizes["BLOCK_N"]
        assert evaluate_grid_formula(k["grid_formula"], sizes)[0] == -(-1000 // bm) * -(-7 // bn)


def test_wrong_architecture_is_named(exported):
    manifest = Manifest.read(exported["rmsnorm"][0])
    arch = manifest.target["arch"]
    wrong = (8, 0) if arch != 80 else (9, 0)
    with pytest.raises(ExportedGraphError, match=rf"exported for {manifest.target['sm']}.*NVIDIA Test GPU has "
                                                 rf"compute capability {wrong[0]}\.{wrong[1]}"):
        manifest.check_device(wrong, "NVIDIA Test GPU")
    manifest.check_device((arch // 10, arch % 10), "the same GPU")  # no error
    # an sm_80 cubin runs on 8.6, not on 9.0 or 7.5
    old = Manifest({**manifest.data, "target": {"arch": 80, "sm": "sm_80", "exact": False}}, manifest.directory)
    old.check_device((8, 6), "A10")
    for cc in [(9, 0), (7, 5)]:
        with pytest.raises(ExportedGraphError, match="sm_80"):
            old.check_device(cc, "other")


def test_missing_file_is_named(exported, tmp_path):
    source, m, _ = exported["rmsnorm"]
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    cubin = m["kernels"][0]["cubin"]
    (copy / cubin).unlink()
    with pytest.raises(ExportedGraphError, match=f"missing: {cubin}"):
        load_exported(copy)  # checked before any CUDA call
    with pytest.raises(ExportedGraphError, match="manifest.json is missing"):
        load_exported(tmp_path / "nowhere")


def test_changed_inputs_are_refused(exported):
    directory, _, inputs = exported["rmsnorm"]
    manifest = Manifest.read(directory)
    x, w = inputs
    manifest.check_inputs((x, w))  # the exported signature passes
    with pytest.raises(ExportedGraphError, match=r"input 0 \(in0\): shape \[17, 200\].*exported for \[16, 200\]"):
        manifest.check_inputs((torch.randn(17, 200, dtype=x.dtype, device=x.device), w))
    with pytest.raises(ExportedGraphError, match="input 1 .*dtype float32"):
        manifest.check_inputs((x, w.float()))
    with pytest.raises(ExportedGraphError, match="input 0 .*strides"):
        manifest.check_inputs((torch.empty(200, 16, dtype=x.dtype, device=x.device).t(), w))
    with pytest.raises(ExportedGraphError, match="takes 2 input"):
        manifest.check_inputs((x,))


def test_graphs_with_eager_fallbacks_are_refused(tmp_path):
    def with_sort(x):
        return sorted_along(x, -1) * 2

    compiled = eqfuse.compile(with_sort, (torch.randn(8, 16, device=DEVICE),))
    assert compiled.fallbacks
    with pytest.raises(ExportError, match="eager fallbacks.*sort"):
        export_graph(compiled, tmp_path, arch="sm_90")
    assert not (tmp_path / "manifest.json").exists()


def test_a_kernel_calling_a_helper_exports(tmp_path):
    """A row's product calls a helper the generated module defines (Triton has no
    tl.prod): the exported kernels' module defines it too, and the kernel compiles."""
    x = torch.rand(8, 16, device=DEVICE) + 0.5
    compiled = eqfuse.compile(lambda x: x.prod(-1) * 2, (x,), autotune=False)
    assert compiled.kernels and not compiled.fallbacks, compiled.explain()
    manifest = json.loads(export_graph(compiled, tmp_path, arch=_arch()).read_text())
    assert len(manifest["kernels"]) == len(compiled.kernels)
    assert "def _row_product" in (tmp_path / "kernels.py").read_text()


def test_unknown_architecture(tmp_path):
    with pytest.raises(AotCompileError, match="unknown GPU architecture 'hopper'"):
        parse_arch("hopper")
    assert parse_arch("sm_90a") == parse_arch("90") == 90


def test_export_command(tmp_path, capsys):
    from eqfuse.cli import main
    assert main(["export", "softmax", "--shape", "8", "64", "--out", str(tmp_path), "--arch", _arch()]) == 0
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["inputs"][0]["shape"] == [8, 64]
    assert "load_exported" in capsys.readouterr().out


def test_inspect_writes_every_stage(tmp_path):
    compiled, _ = _compile("rmsnorm")
    result = compiled.inspect(tmp_path)
    (k,) = result.kernels
    for stage in ("ttir", "ttgir", "llir", "ptx", "cubin", "sass"):
        assert (tmp_path / k["stages"][stage]).stat().st_size > 0, stage
    assert (tmp_path / f"{k['name']}.py").read_text() == compiled.kernels[0].source
    assert k["registers"] > 0 and k["spills"] == 0
    assert k["reqntid"] == [32 * k["num_warps"]]
    # the tl.store line of the kernel is found in every stage's location info
    source = (tmp_path / "kernels.py").read_text().splitlines()
    store = next(i + 1 for i, line in enumerate(source) if "tl.store(" in line)
    assert set(k["lines"][str(store)]) >= {"ttir", "ttgir", "llir", "ptx", "sass"}
    assert "tl.store(" in (tmp_path / "annotated" / k["stages"]["ptx"]).read_text()
    text = str(result)
    assert f"target {result.target}" in text and "registers" in text
    if not torch.cuda.is_available():
        assert "no GPU here" in text


# --- on a GPU: run in a fresh process that never imports Triton --------------------------------
RUNNER = textwrap.dedent("""
    import sys, torch
    from eqfuse.runtime import load_exported
    directory, = sys.argv[1:]
    inputs = torch.load(directory + "/inputs.pt")
    out = load_exported(directory)(*inputs)
    torch.cuda.synchronize()
    torch.save(out, directory + "/outputs.pt")
    assert "triton" not in sys.modules, sorted(m for m in sys.modules if m.startswith("triton"))
    print("ok without triton")
""")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rmsnorm", "softmax", "linear_gelu"])
def test_exported_graph_runs_without_triton(name, tmp_path):
    ex = ALL_EXAMPLES[name]
    torch.manual_seed(0)
    sizes = (64, 1000) if name != "linear_gelu" else (128, 256, 192)
    inputs = ex.make_inputs(*sizes, torch.float16, "cuda")
    export_graph(eqfuse.compile(ex.fn, inputs, autotune=False), tmp_path, arch=_arch())
    torch.save(inputs, tmp_path / "inputs.pt")
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok without triton" in proc.stdout
    got = torch.load(tmp_path / "outputs.pt")
    assert_matches(got, ex.fn(*inputs), contraction=name == "linear_gelu")


@pytest.mark.gpu
def test_exported_graph_errors_on_the_gpu(exported, tmp_path):
    directory, m, inputs = exported["rmsnorm"]
    graph = load_exported(directory)
    assert_matches(graph(*inputs), ALL_EXAMPLES["rmsnorm"].fn(*inputs))
    with pytest.raises(ExportedGraphError, match="shape"):
        graph(torch.randn(17, 200, dtype=torch.float16, device="cuda"), inputs[1])
    wrong = tmp_path / "wrong"
    shutil.copytree(directory, wrong)
    arch = 80 if m["target"]["arch"] != 80 else 90
    (wrong / "manifest.json").write_text(json.dumps({**m, "target": {**m["target"], "arch": arch,
                                                                     "sm": f"sm_{arch}"}}))
    with pytest.raises(ExportedGraphError, match=f"exported for sm_{arch}"):
        load_exported(wrong)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(directory, corrupt)
    cubin = corrupt / m["kernels"][0]["cubin"]
    cubin.write_bytes(cubin.read_bytes()[:-16] + b"\0" * 16)
    with pytest.raises(ExportedGraphError, match="sha256"):
        load_exported(corrupt)


@pytest.mark.gpu
def test_exported_graph_replays_cuda_graphs(exported):
    """Calls at the same addresses replay a recording; a held result is never overwritten."""
    directory, _m, inputs = exported["rmsnorm"]
    graph = load_exported(directory)
    fn = ALL_EXAMPLES["rmsnorm"].fn
    first = graph(*inputs)
    held = [graph(*inputs) for _ in range(3)]  # each call while the earlier results are held
    assert graph.replayer.replays >= 1
    inputs[0].mul_(2)
    again = graph(*inputs)
    for out in [first, *held]:
        assert_matches(out, fn(*(x / 2 if i == 0 else x for i, x in enumerate(inputs))))
    assert_matches(again, fn(*inputs))
    plain = load_exported(directory, cuda_graphs=False)
    assert plain.replayer is None
    assert_matches(plain(*inputs), fn(*inputs))
