"""The benchmark commands run end to end on tiny models and write their table, JSON and plots.

What they measure (tokens/s, α, speedups) depends on the machine, so these tests check what must
hold whatever the timings: the counts the services report agree with each other (every request
used its whole budget; a target pass yields its accepted proposals plus one token), each derived
number is the one computed from the numbers it is reported next to, and each "best" is the fastest
of three or more candidates. The benchmarks' own exactness checks (tools.bench.checks) stop a
run whose speculative tokens differ from plain decoding; tests/test_bench_checks.py shows they do.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tools.bench.theory import expected_speedup, expected_tokens_per_pass

PROMPTS, BUDGET = 2, 12


def same(value: float) -> pytest.approx:
    """Equal up to float rounding: a number recomputed from the JSON as the benchmark computes it."""
    return pytest.approx(value, rel=1e-9, abs=1e-12)


def check_sweep(by_gamma: dict[str, dict], costs: dict) -> None:
    """One γ sweep of bench latency or bench sampling (JSON keys are strings): its counts agree with
    each other and every derived number follows from the numbers beside it."""
    base = by_gamma["0"]
    for key, r in by_gamma.items():
        gamma, decode_passes = int(key), r["passes"] - PROMPTS
        assert r["tokens"] == PROMPTS * BUDGET, key  # ignore_eos: every request used its whole budget
        # The prefill pass yields one token; each decode pass its accepted proposals plus one (γ never
        # exceeds what is left of the budget, so nothing is cut).
        assert r["tokens"] == r["passes"] + r["accepted"], key
        assert r["accepted"] <= r["proposed"] <= gamma * decode_passes, key
        assert r["rejections"] <= decode_passes, key
        assert r["mean_accepted_length"] == same((r["tokens"] - PROMPTS) / decode_passes), key
        assert r["tokens_per_s"] == same(r["tokens"] / r["seconds"]), key
        assert r["speedup"] == same(r["tokens_per_s"] / base["tokens_per_s"]), key
    assert base["proposed"] == 0 and base["alpha"] is None  # γ = 0 is plain decoding: nothing proposed
    for key, r in by_gamma.items():
        if key == "0":
            continue
        gamma = int(key)
        assert r["proposed"] > 0, key  # it did speculate
        assert r["alpha"] == same(r["accepted"] / (r["accepted"] + r["rejections"])), key
        assert r["accepted_fraction"] == same(r["accepted"] / r["proposed"]), key
        assert r["theory"] == same(expected_speedup(r["alpha"], gamma, costs["c"])), key  # measured α and c
        verify = costs["target_verify_ms"][key] / costs["target_step_ms"]
        assert r["theory_with_verify_cost"] == same(expected_tokens_per_pass(r["alpha"], gamma)
                                                    / (gamma * costs["c"] + verify)), key
        assert r["of_theory"] == same(r["speedup"] / r["theory"]), key


def check_costs(costs: dict, gammas: set[str]) -> None:
    assert costs["c"] == same(costs["draft_step_ms"] / costs["target_step_ms"])
    assert set(costs["target_verify_ms"]) == gammas - {"0"}  # a verify cost for every γ > 0 swept


def fastest(by_gamma: dict[str, dict]) -> int:
    return max((int(g) for g in by_gamma if g != "0"), key=lambda g: by_gamma[str(g)]["tokens_per_s"])


def progress_end(err: str, unit: str) -> tuple[int, int]:
    """(done, total) of the last progress line on stderr (tools.progress: off a terminal,
    plain lines), counted in ``unit``."""
    done, total = re.findall(rf"(\d+)/(\d+) {unit} \(", err)[-1]
    return int(done), int(total)


def test_bench_latency_writes_json_and_plots(model_zoo, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "latency", "--target",
                             str(model_zoo["target"]), "--draft", str(model_zoo["partial"]), "--prompts", str(PROMPTS),
                             "--max-new-tokens", str(BUDGET), "--gammas", "0,1,2", "--dtype", "float32",
                             "--proposer", "ngram+model", "--ngram-min", "2", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((out / "latency.json").read_text())
    assert data["proposer"] == {"proposer": "ngram+model", "ngram_max": 4, "ngram_min": 2, "suffix_capacity": 65536}
    assert set(data["gammas"]) == {"0", "1", "2"}
    check_costs(data["costs"], set(data["gammas"]))
    check_sweep(data["gammas"], data["costs"])
    assert data["best_gamma"] == fastest(data["gammas"])  # of two candidates, γ = 0 excluded
    peers = data["peers"]
    assert set(peers) == {"HF plain", "HF assisted", "HF assisted_heuristic", "HF prompt_lookup"}
    assert all(peer["same_tokens_as_ours"] for peer in peers.values())  # greedy, float32 on both sides
    for name, peer in peers.items():
        assert peer["tokens"] == PROMPTS * BUDGET, name  # eos_token_id=None: generates past EOS as ours does
        assert peer["tokens_per_s"] == same(peer["tokens"] / peer["seconds"]), name
    assisted = {name: peer["tokens_per_s"] for name, peer in peers.items() if name != "HF plain"}
    assert data["best_hf_assisted"] == max(assisted, key=assisted.get)  # prompt lookup counts as assisted
    colocated = data["colocated"]
    assert set(colocated) == set(data["gammas"])  # the same sweep with the draft inside the target
    assert data["best_colocated_gamma"] == fastest(colocated)
    for gamma, run in colocated.items():
        assert run["tokens"] == PROMPTS * BUDGET, gamma
        assert run["speedup"] == same(run["tokens_per_s"] / colocated["0"]["tokens_per_s"]), gamma
    auto, alone = data["auto"], data["model_alone"]  # the γ controller; the draft without prompt lookup
    assert auto["tokens"] == alone["tokens"] == PROMPTS * BUDGET and alone["proposed"] > 0
    assert auto["speedup"] == same(auto["tokens_per_s"] / data["gammas"]["0"]["tokens_per_s"])
    assert alone["gamma"] == data["best_gamma"]
    ours_best = max(data["gammas"][str(data["best_gamma"])]["tokens_per_s"],
                    colocated[str(data["best_colocated_gamma"])]["tokens_per_s"], auto["tokens_per_s"])
    assert data["ours_best_speculative_over_plain"] == same(ours_best / data["gammas"]["0"]["tokens_per_s"])
    assert data["ours_over_best_hf_assisted"] == same(ours_best / assisted[data["best_hf_assisted"]])
    assert "dense" not in data  # a float32 safetensors pair has no 4-bit weights to compare with
    assert data["ours_plain_over_hf_plain"] == same(data["gammas"]["0"]["tokens_per_s"]
                                                    / peers["HF plain"]["tokens_per_s"])
    for png in ("latency_speedup.png", "latency_vs_hf.png"):
        assert (out / png).stat().st_size > 1000
    assert "theory x" in result.stdout and "HF assisted" in result.stdout and "draft ms" in result.stdout
    # The engine's own per-pass breakdown, from the target's /metrics, in both layouts: every decode
    # pass of these requests but each one's first, which shares its loop iteration with the prefill
    # (batch 1: one request at a time).
    for layout, runs in (("service", {**data["gammas"], "auto": auto}), ("colocated", colocated)):
        for gamma, run in runs.items():
            parts = run["pass_ms"]
            assert parts["passes"] == run["passes"] - 2 * PROMPTS, (layout, gamma)
            assert parts["target"] > 0 and parts["host"] >= 0, (layout, gamma, parts)
            assert gamma == "0" or parts["draft"] > 0, (layout, gamma, parts)
    # Every generation counted: 2 prompts x (3 γ, auto, 3 γ colocated, the draft alone, HF's 4 modes).
    assert progress_end(result.stderr, "generations") == (24, 24)
    assert "generations (" not in result.stdout  # the progress goes to stderr only


def test_bench_sampling_writes_json_and_plot(model_zoo, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "sampling", "--target",
                             str(model_zoo["target"]), "--draft", str(model_zoo["partial"]), "--prompts", str(PROMPTS),
                             "--max-new-tokens", str(BUDGET), "--gammas", "0,1,2", "--temperatures", "0,1.0",
                             "--dtype", "float32", "--out", str(out), "--no-trees", "--prompt-set", "nonsense"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((out / "sampling.json").read_text())
    assert set(data["temperatures"]) == {"0.0", "1.0"} and data["prompt_set"] == "nonsense"
    check_costs(data["costs"], {"0", "1", "2"})
    for t, entry in data["temperatures"].items():
        assert set(entry["gammas"]) == {"0", "1", "2"}, t
        check_sweep(entry["gammas"], data["costs"])
        assert entry["best_gamma"] == fastest(entry["gammas"]), t
        # speculation=auto, the default, in a stack of its own beside its own plain decoding
        auto, own, base = entry["auto"], entry["auto_plain"], entry["gammas"]["0"]
        assert auto["tokens"] == own["tokens"] == PROMPTS * BUDGET and auto["tokens"] == auto["passes"] + auto["accepted"], t
        assert auto["drafting_passes"] <= auto["passes"] - PROMPTS and own["drafting_passes"] == 0, t
        assert auto["speedup"] == same(auto["tokens_per_s"] / own["tokens_per_s"]), t
        assert f"speculation=auto at T={float(t):g} in its own stack: {auto['speedup']:.2f}x plain decoding" in result.stdout, t
        assert own["speedup"] == same(own["tokens_per_s"] / base["tokens_per_s"]), t  # the two stacks' gap
        # the engine's own clock per pass (the target's /metrics), over each setting's decode passes
        # that prefilled nothing
        assert 0 < base["pass_ms"]["passes"] <= base["passes"] - PROMPTS and auto["pass_ms"]["draft"] >= 0.0, t
        assert 0 < own["pass_ms"]["passes"] <= own["passes"] - PROMPTS, t  # the own stack's target, read too
        assert f"waiting for the draft {auto['pass_ms']['draft']:.2f} ms a pass" in result.stdout, t
    assert "hf" not in data["temperatures"]["0.0"]  # Hugging Face only where we sample
    sampled = data["temperatures"]["1.0"]
    assert {"plain", "assisted", "assisted_heuristic", "prompt_lookup"} == set(sampled["hf"])
    for mode, r in sampled["hf"].items():
        assert r["tokens"] == PROMPTS * BUDGET and r["tokens_per_s"] == same(r["tokens"] / r["seconds"]), mode
    assisted = {mode: r["tokens_per_s"] for mode, r in sampled["hf"].items() if mode != "plain"}
    assert sampled["best_hf_assisted"] == max(assisted, key=assisted.get)
    best = sampled["gammas"][str(sampled["best_gamma"])]
    assert sampled["ours_over_best_hf_assisted"] == same(best["tokens_per_s"] / assisted[sampled["best_hf_assisted"]])
    assert (out / "sampling_speedup.png").stat().st_size > 1000
    assert "theory x" in result.stdout and "HF assisted" in result.stdout
    # --no-trees: no tree stacks (their rows: tests/test_bench_checks.py; a tree stack through the
    # same launcher: bench latency's test above; sampled trees in three processes: test_smollm2.py)
    assert "trees" not in data and "sampled trees" not in result.stdout
    # 2 prompts x (2 T x (3 γ + auto + its own plain) + 4 HF modes at T=1)
    assert progress_end(result.stderr, "generations") == (28, 28)


def test_bench_synthetic_on_a_small_target(tmp_path):
    from tools.bench import synthetic

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True}
    result = synthetic.run(tmp_path, alphas=[0.5, 1.0], gammas=[2], n_prompts=2, max_new_tokens=24, shape=shape)
    assert result["alphas"][1.0][2]["alpha_measured"] == 1.0  # the oracle's uncorrupted guesses: all accepted
    assert 0.1 < result["alphas"][0.5][2]["alpha_measured"] < 0.9
    costs = result["costs"]
    for alpha, by_gamma in result["alphas"].items():
        r = by_gamma[2]
        assert r["speedup"] == same(r["tokens_per_s"] / result["plain_tokens_per_s"]), alpha
        assert r["theory"] == same(expected_speedup(r["alpha_measured"], 2, 0.0)), alpha  # c = 0
        assert r["of_theory"] == same(r["speedup"] / r["theory"]), alpha
        assert r["verify_cost_ratio"] == same(costs["target_verify_ms"][2] / costs["target_step_ms"]), alpha
        assert r["theory_with_verify_cost"] == same(r["theory"] / r["verify_cost_ratio"]), alpha
    assert (tmp_path / "synthetic_speedup.png").stat().st_size > 1000


def test_bench_throughput_reports_occupancy_and_ratios(model_zoo, tmp_path, capsys):
    from tools.bench import throughput
    from tools.bench.models import BenchModels
    from tools.bench.throughput import Setting

    n = 2
    settings = [Setting(n, "static", 1.0, "all", 0), Setting(n, "topup", 1.0, "all", 0),
                Setting(n, "topup", 1.0, "min_length", 2)]
    models = BenchModels("zoo", model_zoo["target"], model_zoo["partial"], "float32")
    data = throughput.run(models, tmp_path, ["short"], settings, count=12)
    runs = {r["setting"]["name"]: r for r in data["runs"]}
    assert set(runs) == {"n=2 static all γ=0", "n=2 topup ε=1 all γ=0", "n=2 topup ε=1 min_length γ=2"}
    budgets = sum(budget for _, budget in throughput.workload(models, "short", 12))
    for name, r in runs.items():
        assert r["requests"] == 12 and r["tokens"] == budgets, name  # ignore_eos: every budget used in full
        assert r["tokens_per_s"] == same(r["tokens"] / r["seconds"]), name
        histogram = r["occupancy_histogram"]  # histogram[k]: steps that expanded k rows
        assert len(histogram) == n + 1 and sum(histogram) == r["steps"] > 0, name
        assert sum(k * steps for k, steps in enumerate(histogram)) == same(r["expansions_per_step"] * r["steps"]), name
        assert r["mean_occupancy"] == same(r["expansions_per_step"] / n), name
    static, topup = runs["n=2 static all γ=0"], runs["n=2 topup ε=1 all γ=0"]
    assert topup["over_static"] == same(topup["tokens_per_s"] / static["tokens_per_s"])
    assert runs["n=2 topup ε=1 min_length γ=2"]["over_static"] is None  # no static run with that selection and γ
    assert (tmp_path / "throughput_occupancy.png").stat().st_size > 1000
    # 3 settings x (a warm-up of 2n = 4 requests + the 12 measured)
    assert progress_end(capsys.readouterr().err, "requests") == (48, 48)


def test_bench_profile_splits_a_step_into_its_parts(model_zoo, tmp_path, capsys):
    from tools.bench import profile
    from tools.bench.models import BenchModels

    vocab = json.loads((model_zoo["target"] / "config.json").read_text())["vocab_size"]
    data = profile.run(BenchModels("zoo", model_zoo["target"], model_zoo["partial"], "float32"), tmp_path)
    assert f"output layer ({vocab} rows)" in data["target_step"]
    for kind in ("target_step", "target_verify5", "draft_step"):
        whole = data[kind]["whole forward"]
        timed = {k: v for k, v in data[kind].items() if k not in ("whole forward", "Python and dispatch between them")}
        # embedding, attention and MLP op by op, the layers as served (float32: op by op), output
        assert len(timed) == 5 and all(v > 0 for v in timed.values()), kind
        assert any(k.startswith("layers as served x") and k.endswith("(op by op)") for k in timed), kind
        served = sum(v for k, v in timed.items() if not k.startswith(("attention", "MLP")))
        assert data[kind]["Python and dispatch between them"] == same(max(whole - served, 0.0)), kind
    rpc = data["rpc"]
    assert rpc["RPC + serialisation"] == same(max(rpc["gRPC round trip"] - rpc["draft compute, in process"], 0.0))
    assert "output layer" in data["table_markdown"] and (tmp_path / "profile.png").stat().st_size > 1000
    # 6 per forward (5 parts and the whole) for the target's step and verify and the draft's step,
    # the draft's proposals in process and over gRPC
    assert progress_end(capsys.readouterr().err, "timings") == (20, 20)


def test_bench_kernels_times_the_output_layer_and_a_steps_share(model_zoo, tmp_path, capsys):
    from tools.bench import kernels as kernel_bench
    from tools.bench.models import BenchModels

    models = BenchModels("zoo", model_zoo["target"], model_zoo["partial"], "float32")
    data = kernel_bench.run(tmp_path, "cpu", vocabs=(123, 300), rows=(1, 8), hiddens=(32,), models=models)
    assert data["device"].startswith("CPU") and data["fused_measured"] is False  # no GPU: torch timings only
    assert [(s["vocab"], s["rows"]) for s in data["sizes"]] == [(123, 1), (123, 8), (300, 1), (300, 8)]
    assert all(set(s["ms"]) == {"unfused 1-best + logprob", "unfused sample"} and min(s["ms"].values()) > 0
               for s in data["sizes"])
    assert set(data["steps"]) == {"1", "8"} and all(t["layers"] > 0 for t in data["steps"].values())
    assert json.loads((tmp_path / "kernels.json").read_text())["sizes"] == data["sizes"]
    assert "share" in kernel_bench.tables(data) and (tmp_path / "kernels.png").stat().st_size > 1000
    assert progress_end(capsys.readouterr().err, "measurements") == (6, 6)  # 4 sizes, 2 decode steps


def test_bench_kernels_fused_columns_run_through_the_dispatcher(tmp_path):
    """What a CUDA run adds (fused ops, the verification against its bandwidth bound), run here by
    Triton's interpreter at tiny sizes: the code path works; the timings mean nothing on a CPU."""
    from tools.bench import kernels as kernel_bench

    data = kernel_bench.run(tmp_path, "cpu", vocabs=(123,), rows=(1,), hiddens=(32,), fused=True, verify_shape=(2, 2))
    [size] = data["sizes"]
    assert set(size["ms"]) == {"unfused 1-best + logprob", "unfused sample", "fused 1-best + logprob", "fused sample"}
    [verify] = data["verification"]
    assert verify["bytes"] == 2 * 3 * 123 * 2 and verify["ms"] > 0 and verify["read bound ms"] > 0
    assert "unfused ÷ fused" in kernel_bench.tables(data) and "÷ bound" in kernel_bench.tables(data)


def test_bench_gamma_compares_policies_and_proposers(model_zoo, tmp_path, capsys):
    from tools.bench import gamma
    from tools.bench.models import BenchModels

    models = BenchModels("zoo", model_zoo["target"], model_zoo["partial"], "float32")
    data = gamma.run(models, tmp_path, [1, 2], n_prompts=2, max_new_tokens=8, names=["code", "repetitive", "mix"],
                     fixed=(0, 2), proposers=("model", "ngram"))
    assert data["settings"] == ["γ=0", "γ=2", "HF heuristic", "Leviathan", "ours", "ours ngram"]
    assert set(data["runs"]) == {f"{b}/{w}" for b in (1, 2) for w in ("code", "repetitive", "mix")}
    for key, summary in data["runs"].items():
        runs = summary["settings"]
        requests = 8 if key.endswith("mix") and key.startswith("1/") else 2 if key.startswith("1/") else 4
        fixed = {n: r["tokens_per_s"] for n, r in runs.items() if n.startswith("γ=")}
        assert summary["best_fixed"] == max(fixed, key=fixed.get), key
        for name, r in runs.items():
            assert r["tokens"] == 8 * requests, (key, name)
            # every decode pass is in the γ histogram; the first token of each request is prefill's
            assert sum(r["gamma_histogram"].values()) == r["decode_passes"], (key, name)
            assert sum(int(g) * n for g, n in r["gamma_histogram"].items()) == r["proposed"], (key, name)
            assert r["tokens"] == requests + r["decode_passes"] + r["accepted"], (key, name)
            assert r["over_plain"] == r["tokens_per_s"] / runs["γ=0"]["tokens_per_s"]
            assert r["over_best_fixed"] == r["tokens_per_s"] / fixed[summary["best_fixed"]]
        assert runs["γ=0"]["proposed"] == 0 and set(runs["γ=2"]["gamma_histogram"]) <= {"0", "1", "2"}
    # The n-gram proposer's guesses are proposed and accepted. Over all workloads: the controller
    # prices guesses from measured step times, and on a loaded machine it let the n-gram guess
    # once in 1/repetitive (3 guesses, none kept) while it kept 17 elsewhere.
    ngram = [summary["settings"]["ours ngram"] for summary in data["runs"].values()]
    assert sum(r["accepted"] for r in ngram) > 0
    assert (tmp_path / "gamma_vs_best_fixed.png").stat().st_size > 1000
    assert "ours ÷ best fixed" in gamma.tables(data, markdown=True)
    # 6 settings x (batch 1: 2 + 2 + 8 requests, batch 2: 4 per workload)
    assert progress_end(capsys.readouterr().err, "requests") == (144, 144)



def test_bench_throughput_through_both_fronts_on_real_processes(model_zoo, tmp_path):
    """The same requests through the gRPC SDK and the `openai` client against one stack; the run
    itself checks both fronts return the same greedy tokens (BenchmarkError otherwise)."""
    from tools.bench import throughput
    from tools.bench.models import BenchModels
    from tools.bench.throughput import Setting

    models = BenchModels("zoo", model_zoo["target"], model_zoo["partial"], "float32")
    setting = Setting(2, "topup", 1.0, "all", 2)
    data = throughput.run(models, tmp_path, ["short"], [setting], count=8, fronts=("grpc", "http"))
    runs = {r["front"]: r for r in data["runs"]}
    budgets = sum(budget for _, budget in throughput.workload(models, "short", 8))
    assert set(runs) == {"grpc", "http"}
    assert all(r["passes"] == 2 and r["tokens"] == 2 * budgets for r in runs.values())
    (overhead,) = data["front_overhead"]
    assert overhead["tokens_per_s_ratio"] == same(runs["http"]["tokens_per_s"] / runs["grpc"]["tokens_per_s"])
    assert (tmp_path / "throughput_fronts.png").stat().st_size > 1000


def goals_met(data: dict, goal: str) -> bool:
    (line,) = [g for g in data["goals"] if g["goal"] == goal]
    return line["met"]


def test_bench_step_measures_the_bound_the_verify_curve_and_the_host_work(model_zoo, tmp_path, capsys):
    from tools.bench import step
    from tools.bench.models import BenchModels

    data = step.run(BenchModels("zoo", model_zoo["target"], None, "float32"), tmp_path)
    assert data["bytes"]["total"] == sum(v for k, v in data["bytes"].items() if k != "total") > 0
    assert data["bound_ms"] == same(data["bytes"]["total"] / data["bandwidth_gbs"][data["threads"]] / 1e6)
    assert set(data["ours"]) == set(step.POSITIONS) and all(ms > 0 for ms in data["ours"].values())
    # a dense float32 target: no native layers to run op by op instead, and no dense variant beside it
    assert "ours_op_by_op" not in data and "dense" not in data
    assert data["verify_over_step"][16] == same(data["ours"][16] / data["ours"][1])
    # a verify at a long context (as long as the tiny target reaches), heads grouped and one by one
    assert 0 < data["long_context"] <= step.LONG_CONTEXT
    assert all(set(curve) == set(step.LONG_POSITIONS) for curve in data["long"].values())
    assert set(data["long"]) == {"ours", "heads_one_by_one"}
    for batch, host in data["host"].items():  # plain decoding on an in-process engine, from its own timings
        assert host["steps"] > 0 and host["step_ms"] > host["compute_ms"] > host["forward_ms"] > 0, batch
        assert host["host_ms"] == same(host["step_ms"] - host["compute_ms"])
    noisy = data["step_noisy"]
    assert data["step_noisy_over_quiet"] == same((noisy["quiet"] + noisy["quiet again"]) / 2 / noisy["noisy"])
    for batch, tps in data["batch_throughput"].items():  # the model as it serves against the torch paths
        assert tps["new"] > 0 and tps["old"] > 0 and tps["ratio"] == same(tps["new"] / tps["old"]), batch
        assert goals_met(data, f"batch {batch} tokens/s ÷ the torch paths'") == (tps["ratio"] >= 1.3)
    # plain decoding through a launched stack: quiet, loops in our session, quiet, loops in another, ... quiet
    served = data["served"]
    assert len(served["quiet_runs"]) == 5 and len(served["noisy_runs"]) == len(served["other_session_runs"]) == 2
    assert min(served["quiet_runs"] + served["noisy_runs"] + served["other_session_runs"]) > 0
    assert served["quiet"] == same(sum(served["quiet_runs"]) / 5)
    assert served["noisy_over_quiet"] == same(served["noisy"] / served["quiet"])
    assert served["noisy"] == same(sum(served["noisy_runs"]) / 2)
    assert served["other_session_over_quiet"] == same(served["other_session"] / served["quiet"])
    assert served["other_session"] == same(sum(served["other_session_runs"]) / 2)
    fixed = served["fixed_threads"]  # a second stack, its thread count fixed: quiet and beside the other session's
    assert len(fixed["quiet_runs"]) == 5 and len(fixed["other_session_runs"]) == 2
    assert fixed["other_session_over_quiet"] == same(fixed["other_session"] / fixed["quiet"])
    assert served["other_session_over_fixed_threads"] == same(served["other_session"] / fixed["other_session"])
    assert "llama_cpp" not in served  # no GGUF file to run it on
    prefill = data["prefill"]  # a long prompt (as long as the tiny target reaches) and the chat prompts, as served
    assert len(prefill["tokens"]) == len(prefill["ours_ms"]) == 1 + step.PREFILL_CHAT_PROMPTS
    assert 0 < prefill["tokens"][0] <= 512
    assert all(ms > 0 for ms in prefill["ours_ms"]) and "llama_cpp_ms" not in prefill
    assert prefill["ours_tokens_per_s"][0] == same(prefill["tokens"][0] / prefill["ours_ms"][0] * 1e3)
    assert data["llama_cpp"] is None and "no GGUF file" in data["llama_cpp_note"]  # a safetensors target
    # logits against the file's values in float32: this float32 target serves them unchanged (no
    # native layers, so no 8-bit activation variant)
    assert set(data["accuracy"]) == {"dense", "ours"} and "ours_int8_activations" not in data
    assert all(a["mean_abs"] == a["max_abs"] == 0 and a["top1_agree"] == 1 for a in data["accuracy"].values())
    goals = {g["goal"]: g for g in data["goals"]}
    assert goals["verify over 16 ÷ step"]["met"] == (data["verify_over_step"][16] <= 1.6)
    assert goals["served decoding, noisy ÷ quiet"]["met"] == (served["noisy_over_quiet"] >= 0.9)
    assert goals["served decoding, loops in another session ÷ quiet"]["met"] == (
        served["other_session_over_quiet"] >= 0.45)
    assert (tmp_path / "step.json").exists() and (tmp_path / "step.png").stat().st_size > 1000
    assert "bandwidth" in capsys.readouterr().out


def test_bench_overlap_times_each_side_alone_and_side_by_side(model_zoo, tmp_path):
    """`bench overlap` on the tiny pair (float32): the target's verify and the draft's propose call,
    each alone and while the other runs back to back, in two processes; the passes it derives follow
    from what it measured. Then the served stacks with and without the draft working ahead: every
    setting at every γ, the working ones preparing rounds, with the output of the one without."""
    from tools.bench import ahead, overlap
    from tools.bench.models import BenchModels

    models = BenchModels("zoo", model_zoo["target"], model_zoo["partial"], "float32")
    # Of the nine: the defaults, and a stack that asks early and works ahead on three outcomes a
    # chain (each stack ~5 s here).
    settings = [ahead.Setting(), ahead.Setting("normal", early=True, outcomes=3)]
    data = overlap.run(models, tmp_path, gammas=[1, 3], seconds=0.2, quiet=True, served_prompts=1, max_new_tokens=12,
                       served_settings=settings)
    rows = data["served"]["rows"]
    assert set(rows) == {f"gamma {g}, {ahead._name(s)}" for g in (0, 1, 3, "auto") for s in settings}
    for setting in settings:
        row = rows[f"gamma 1, {ahead._name(setting)}"]
        assert row["tokens_per_s"] > 0 and row["pass_ms"]["passes"] > 0
        if setting.work_ahead == "off":
            assert row["prepared_per_pass"] == 0 and row["hit_rate"] == "-"
        else:  # γ = 1 drafts every pass: a round is prepared after each reply the model gave
            assert row["prepared_per_pass"] > 0 and row["hits"] + row["misses"] > 0
            assert 0 <= row["runner_up_hits"] <= row["hits"]
    assert (tmp_path / "ahead.png").stat().st_size > 1000
    assert set(data["gammas"]) == {1, 3}
    for gamma, e in data["gammas"].items():
        assert min(e["verify_ms"], e["verify_draft_busy_ms"], e["draft_ms"], e["draft_target_busy_ms"]) > 0, gamma
        assert e["sequential_ms"] == same(e["verify_ms"] + e["draft_ms"])
        assert e["overlapped_ms"] == same(overlap.overlapped_pass_ms(e["verify_ms"], e["verify_draft_busy_ms"],
                                                                     e["draft_ms"], e["draft_target_busy_ms"]))
        assert e["wrong_guess_ms"] == same(max(e["overlapped_ms"] - e["verify_ms"], 0.0))
    json_data = json.loads((tmp_path / "overlap.json").read_text())
    assert set(json_data["gammas"]) == {"1", "3"} and (tmp_path / "overlap.png").stat().st_size > 1000


def test_bench_overlaps_served_part_samples_and_compares_the_stacks_that_guess_alike(model_zoo):
    """The served part sampled (`bench overlap --temperatures 1`): seeded requests; at every fixed γ
    the stack asking early emits the defaults' tokens (compared, or the run fails), while the stack
    working ahead, whose prepared rounds may be other draws, and `auto` are named as not compared."""
    from tools.bench import ahead
    from tools.bench.models import BenchModels
    from tools.progress import Progress

    models = BenchModels("zoo", model_zoo["target"], model_zoo["partial"], "float32")
    settings = [ahead.Setting(), ahead.Setting(early=True), ahead.Setting("normal", outcomes=3)]
    with Progress(ahead.planned_generations(1, [1, "auto"], settings), "generations", "test", quiet=True) as progress:
        sampled, _ = ahead.served(models, [1, "auto"], 1, 16, progress, settings, temperature=1.0)
    assert sampled["temperature"] == 1.0
    assert sampled["tokens_checked"] == {"gammas": [1], "stacks": [ahead._name(settings[1])]}
    working = sampled["rows"][f"gamma 1, {ahead._name(settings[2])}"]
    assert working["prepared_per_pass"] > 0 and working["hits"] + working["misses"] > 0
    assert sampled["rows"]["gamma 1, " + ahead._name(settings[1])]["tokens_per_s"] > 0


def test_an_overlapped_pass_runs_both_at_their_shared_speed_until_the_first_ends():
    from tools.bench.overlap import overlapped_pass_ms

    # The draft (2 ms, 4 beside the target) ends first, at 4 ms: the target did 4/10 of its 5 ms meanwhile.
    assert overlapped_pass_ms(5.0, 10.0, 2.0, 4.0) == same(4.0 + 0.6 * 5.0)
    # The target ends first: symmetric.
    assert overlapped_pass_ms(1.0, 2.0, 3.0, 6.0) == same(2.0 + (1 - 2.0 / 6.0) * 3.0)
    # Side by side at full speed: the longer of the two.
    assert overlapped_pass_ms(5.0, 5.0, 2.0, 2.0) == same(5.0)
    # Whenever sharing slows each side down, the overlapped pass lies between the longer side alone
    # and the longer side at its shared speed.
    import random

    rng = random.Random(0)
    for _ in range(1000):
        v, d = rng.uniform(0.1, 10), rng.uniform(0.1, 10)
        v_busy, d_busy = v * rng.uniform(1, 3), d * rng.uniform(1, 3)
        o = overlapped_pass_ms(v, v_busy, d, d_busy)
        assert max(v, d) - 1e-9 <= o <= max(v_busy, d_busy) + 1e-9, (v, v_busy, d, d_busy, o)


def test_bench_structured_writes_json_and_plot_and_checks_every_row_against_constrained_plain(tmp_path):
    """On the default pair, two short workloads: every constrained row's tokens equal constrained
    plain's (the benchmark stops otherwise), each answer is checked against its constraint, and the
    derived numbers follow from the ones beside them."""
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "structured", "--workloads",
                             "json-enum,choice", "--max-new-tokens", "40", "--out", str(out), "--quiet"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((out / "structured.json").read_text())
    assert (out / "structured.png").stat().st_size > 0
    assert set(data["workloads"]) == {"json-enum", "choice"} and data["cpu"]
    for name, workload in data["workloads"].items():
        rows = workload["rows"]
        plain = rows["constrained plain"]
        hf = rows["transformers + llguidance"]  # the peer with the same grammar library, every workload
        assert hf["valid"] == hf["answers"] == 2 and hf["tokens_per_s"] > 0, name
        for row, r in rows.items():
            if row.startswith(("llama.cpp", "transformers")):
                continue
            base = rows["constrained plain, sampled" if row.endswith("sampled") else "constrained plain"]
            assert r["vs_constrained_plain"] == same(r["tokens_per_s"] / base["tokens_per_s"]), (name, row)
            assert r["decode_tokens_per_s"] is None or r["decode_tokens_per_s"] > 0, (name, row)
            if row.endswith("sampled"):  # other draws of the same distribution: valid, not equal
                assert r["equals_constrained_plain"] is None and r["valid"] == 1.0, (name, row)
            elif row != "unconstrained plain":
                assert r["equals_constrained_plain"] is True and r["valid"] == 1.0, (name, row)
        assert rows["constrained plain"]["alpha"] is None  # nothing proposed without speculation
    # The enum JSON's keys and quotes are forced: proposed at no cost, always accepted.
    enum = data["workloads"]["json-enum"]
    assert 0 < enum["forced_share"] < 1
    assert enum["rows"]["+ forced tokens only"]["tokens_per_pass"] > 1.0
    assert 0 < enum["rows"]["+ grammar-aware draft (ours)"]["alpha"] <= 1
