"""Calibration storage, the cost model's use of it, and ``eqfuse bench`` on a tiny suite."""

import dataclasses
import json

import pytest
import torch

from eqfuse import bench
from eqfuse.errors import EqfuseError
from eqfuse.rewrite import cost


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EQFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost, "_calibrations", None)
    yield tmp_path
    cost._calibrations = None


def test_a_stored_calibration_is_the_model_of_its_device(fresh_cache):
    measured = dataclasses.replace(cost.DEFAULT_DEVICE, name="Test GPU", bandwidth_bytes_per_us=1.0e6, launch_us=7.5)
    cost.save_calibration(measured)
    assert cost.device_model("Test GPU") == measured
    assert cost.device_model("Another GPU") == cost.DEFAULT_DEVICE
    other = dataclasses.replace(measured, name="Second GPU", launch_us=1.0)
    cost.save_calibration(other)  # a second device keeps the first one's entry
    assert cost.device_model("Test GPU").launch_us == 7.5
    assert cost.device_model("Second GPU").launch_us == 1.0


def test_an_unreadable_calibration_file_means_defaults(fresh_cache):
    (fresh_cache / "devices.json").write_text("{not json")
    assert cost.device_model("Test GPU") == cost.DEFAULT_DEVICE
    cost._calibrations = None
    (fresh_cache / "devices.json").write_text(json.dumps({"Test GPU": {"launch_us": "x", "bogus": 1},
                                                           "Good GPU": {"name": "Good GPU", "launch_us": 2.0}}))
    assert cost.device_model("Good GPU").launch_us == 2.0
    assert cost.device_model("Good GPU").bandwidth_bytes_per_us == cost.DEFAULT_DEVICE.bandwidth_bytes_per_us


def test_the_cost_model_follows_the_calibrated_figures():
    from eqfuse.schema.plan import Buffer, KernelSpec, PNode
    n = 1 << 20
    load = PNode("load", ("x", (1,), 0), (), (n,), "float32")
    spec = KernelSpec("k", [(load, "y")])
    buffers = {"x": Buffer("x", (n,), "float32", "input"), "y": Buffer("y", (n,), "float32", "output")}
    slow = dataclasses.replace(cost.DEFAULT_DEVICE, bandwidth_bytes_per_us=1.0e6, launch_us=5.0)
    fast = dataclasses.replace(slow, bandwidth_bytes_per_us=2.0e6)
    t_slow, t_fast = cost.kernel_time_us(spec, buffers, slow), cost.kernel_time_us(spec, buffers, fast)
    bytes_moved = 2 * n * 4
    assert t_slow == pytest.approx(5.0 + bytes_moved / 1.0e6)
    assert t_fast == pytest.approx(5.0 + bytes_moved / 2.0e6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without a GPU")
def test_calibrate_without_a_gpu_says_so():
    from eqfuse.runtime.calibrate import calibrate
    with pytest.raises(EqfuseError, match="measures a CUDA GPU and this machine has none"):
        calibrate(progress=lambda _: None)


def test_spearman_and_ranking_summary():
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert bench.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert bench.spearman([1, 2], [1, 2]) is None
    # tied values share their mean rank: the order of the pairs does not change the result
    assert bench.spearman([1, 1, 2, 3], [2, 1, 3, 4]) == pytest.approx(bench.spearman([1, 1, 2, 3], [1, 2, 3, 4]))
    assert bench.spearman([5, 5, 5], [1, 2, 3]) is None  # a constant side ranks nothing
    rows = [{"plans": [{"predicted_us": 1.0, "measured_us": 2.0}, {"predicted_us": 3.0, "measured_us": 5.0}]},
            {"plans": [{"predicted_us": 4.0, "measured_us": 9.0}, {"predicted_us": 2.0, "measured_us": 1.0}]}]
    summary = bench.ranking_summary(rows)
    assert summary["plans"] == 4
    assert summary["workloads_ordered_right"] == "2/2"
    assert summary["spearman"] == pytest.approx(0.8)


def test_bench_on_a_tiny_suite_writes_table_json_and_chart(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "ROUNDS", 1)
    printed = []
    result = bench.run(tiny=True, out_dir=str(tmp_path), only=["RMSNorm 4096", "softmax"], print_=printed.append,
                       contenders=["eqfuse"])
    rows = result["results"]
    assert [r["workload"] for r in rows] == ["RMSNorm 4096x4096 fp16", "softmax 4096x4096 fp32"]
    for r in rows:
        eq = r["contenders"]["eqfuse"]
        assert eq["matches_eager"] and eq["kernels"] == 1 and eq["fallbacks"] == []
        assert eq["us"] > 0 and eq["compile_s_cold"] > 0 and eq["compile_s_warm"] > 0
        assert r["contenders"]["eager"]["speedup_vs_eager"] == 1.0
        assert {p["plan"] for p in r["plans"]} == {"fused", "unfused"}
        fused = next(p for p in r["plans"] if p["plan"] == "fused")
        unfused = next(p for p in r["plans"] if p["plan"] == "unfused")
        assert fused["kernels"] < unfused["kernels"]
    table = next(p for p in printed if p.startswith("workload"))
    header, subheader, rule, *lines = table.splitlines()
    assert "eager us" in header and "eqfuse us" in header and "eqfuse compile s" in header
    assert subheader.split() == ["cold", "/", "warm"] and set(rule) == {"-"}
    assert len(lines) == 2 and lines[0].startswith("RMSNorm 4096x4096 fp16")
    saved = json.loads(open(result["json_path"]).read())
    assert saved["tiny"] is True and saved["results"] == json.loads(json.dumps(rows))
    assert {"device", "date", "torch", "triton", "eqfuse", "ranking"} <= set(saved)
    with open(result["png_path"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    progress = capsys.readouterr().err.splitlines()
    assert progress[-1].startswith("[" + "#" * 30 + "] 2/2 ")


def test_bench_resumes_where_an_earlier_run_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ROUNDS", 1)
    quiet = {"print_": lambda _: None, "contenders": ["eqfuse"], "chart": False, "out_dir": str(tmp_path)}
    first = bench.run(tiny=True, only=["RMSNorm 4096"], **quiet)
    measured = first["results"][0]
    monkeypatch.setattr(bench, "run_workload", lambda w, *a: {"workload": w.name, "contenders": {}, "new": True})
    second = bench.run(tiny=True, only=["RMSNorm 4096", "softmax"], resume=True, **quiet)
    assert [r["workload"] for r in second["results"]] == ["RMSNorm 4096x4096 fp16", "softmax 4096x4096 fp32"]
    assert second["results"][0] == measured and second["results"][1]["new"]


def test_bench_names_the_workloads_when_none_match():
    with pytest.raises(ValueError, match="no workload matches .* the suite has: RMSNorm 4096x4096 fp16"):
        bench.run(tiny=True, only=["no such thing"], print_=lambda _: None)
