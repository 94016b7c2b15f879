"""The benchmark commands run end to end on tiny models and write their table, JSON and plots."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_latency_writes_json_and_plots(model_zoo, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "specstream.cli", "bench", "latency", "--target",
                             str(model_zoo["target"]), "--draft", str(model_zoo["partial"]), "--prompts", "2",
                             "--max-new-tokens", "12", "--gammas", "0,2", "--dtype", "float32", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((out / "latency.json").read_text())
    two = data["gammas"]["2"]
    assert two["proposed"] > 0 and 0 <= two["alpha"] <= 1
    assert data["costs"]["c"] > 0 and two["theory"] > 0 and two["speedup"] > 0
    assert set(data["peers"]) == {"HF plain", "HF assisted", "HF assisted_heuristic", "HF prompt_lookup"}
    assert all(peer["same_tokens_as_ours"] for peer in data["peers"].values())  # greedy, float32 on both sides
    assisted = {name: peer["tokens_per_s"] for name, peer in data["peers"].items() if name != "HF plain"}
    assert data["best_hf_assisted"] == max(assisted, key=assisted.get)  # prompt lookup counts as assisted
    assert data["ours_plain_over_hf_plain"] > 0
    for png in ("latency_speedup.png", "latency_vs_hf.png"):
        assert (out / png).stat().st_size > 1000
    assert "theory x" in result.stdout and "HF assisted" in result.stdout



def test_bench_sampling_writes_json_and_plot(model_zoo, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "specstream.cli", "bench", "sampling", "--target",
                             str(model_zoo["target"]), "--draft", str(model_zoo["partial"]), "--prompts", "2",
                             "--max-new-tokens", "12", "--gammas", "0,2", "--temperatures", "0,1.0", "--dtype", "float32",
                             "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((out / "sampling.json").read_text())
    assert set(data["temperatures"]) == {"0.0", "1.0"} and data["costs"]["c"] > 0
    for t, entry in data["temperatures"].items():
        base, two = entry["gammas"]["0"], entry["gammas"]["2"]
        assert base["tokens"] == two["tokens"] == 2 * 12, t
        assert base["proposed"] == 0 and base["speedup"] == 1.0, t
        assert two["proposed"] > 0 and 0 <= two["alpha"] <= 1 and 0 <= two["accepted_fraction"] <= 1, t
        assert 1 <= two["mean_accepted_length"] <= 3, t
        assert two["tokens_per_s"] > 0 and two["speedup"] > 0 and two["theory"] > 0 and two["of_theory"] > 0, t
        assert entry["best_gamma"] == 2, t
    sampled = data["temperatures"]["1.0"]
    assert "hf" not in data["temperatures"]["0.0"]
    assert {"plain", "assisted", "assisted_heuristic", "prompt_lookup"} == set(sampled["hf"])
    assert all(mode["tokens"] == 2 * 12 and mode["tokens_per_s"] > 0 for mode in sampled["hf"].values())
    assert sampled["ours_over_best_hf_assisted"] > 0
    assert (out / "sampling_speedup.png").stat().st_size > 1000
    assert "theory x" in result.stdout and "HF assisted" in result.stdout

def test_bench_synthetic_on_a_small_target(tmp_path):
    from specstream.bench import synthetic

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True}
    result = synthetic.run(tmp_path, alphas=[0.5, 1.0], gammas=[2], n_prompts=2, max_new_tokens=24, shape=shape)
    assert result["alphas"][1.0][2]["alpha_measured"] == 1.0
    assert 0.1 < result["alphas"][0.5][2]["alpha_measured"] < 0.9
    assert (tmp_path / "synthetic_speedup.png").stat().st_size > 1000


def test_bench_throughput_reports_occupancy_and_ratios(model_zoo, tmp_path):
    from specstream.bench import throughput
    from specstream.bench.models import BenchModels
    from specstream.bench.throughput import Setting

    settings = [Setting(2, "static", 1.0, "all", 0), Setting(2, "topup", 1.0, "all", 0),
                Setting(2, "topup", 1.0, "min_length", 2)]
    models = BenchModels("zoo", model_zoo["target"], model_zoo["partial"], "float32")
    data = throughput.run(models, tmp_path, ["short"], settings, count=12)
    runs = {r["setting"]["name"]: r for r in data["runs"]}
    assert len(runs) == 3 and all(r["requests"] == 12 and r["tokens_per_s"] > 0 for r in runs.values())
    topup = runs["n=2 topup ε=1 all γ=0"]
    assert topup["over_static"] > 0 and 0 < topup["mean_occupancy"] <= 1
    assert sum(topup["occupancy_histogram"]) == topup["steps"] > 0
    assert runs["n=2 static all γ=0"]["over_static"] == 1.0
    assert (tmp_path / "throughput_occupancy.png").stat().st_size > 1000


def test_bench_profile_splits_a_step_into_its_parts(model_zoo, tmp_path):
    from specstream.bench import profile
    from specstream.bench.models import BenchModels

    data = profile.run(BenchModels("zoo", model_zoo["target"], model_zoo["partial"], "float32"), tmp_path)
    for kind in ("target_step", "target_verify5"):
        parts = {k: v for k, v in data[kind].items() if k != "whole forward"}
        assert len(parts) == 5 and all(v >= 0 for v in parts.values())
        assert data[kind]["whole forward"] > 0 and abs(sum(parts.values()) - data[kind]["whole forward"]) < 0.05 * \
            data[kind]["whole forward"] + 0.5  # the parts account for the forward
    assert data["draft_step"]["whole forward"] > 0
    assert data["rpc"]["gRPC round trip"] > 0 and data["rpc"]["draft compute, in process"] > 0
    assert "output layer" in data["table_markdown"] and (tmp_path / "profile.png").stat().st_size > 1000
