"""The benchmarks' checks on their own results (tools.bench.checks): each passes on matching
data, fails on mismatching data naming what differed, and still fails under `python -O`; and the
benchmarks that compare token ids (latency, sampling, synthetic) stop on a mismatch. No models:
the stack and the sweeps are replaced by fakes."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from tools.bench.checks import BenchmarkError, check_runs_match, check_same_tokens, require, token_difference
from tools.bench.hf import MODES, runnable_modes


def test_require():
    require(True, "never raised")
    require([1], "a non-empty list holds")
    with pytest.raises(BenchmarkError, match="counts do not add up"):
        require(False, "counts do not add up")
    with pytest.raises(BenchmarkError):
        require(0, "zero does not hold")
    assert issubclass(BenchmarkError, RuntimeError)  # callers that caught the old RuntimeError still do


def test_equal_runs_pass():
    runs = [[5, 6, 7], [8, 9]]
    assert token_difference(runs, [list(r) for r in runs]) is None
    assert token_difference([], []) is None
    check_same_tokens("equal", runs, [[5, 6, 7], [8, 9]])
    check_runs_match("output", "plain", runs, {"gamma 2": [[5, 6, 7], [8, 9]], "gamma 4": runs})
    check_runs_match("output", "plain", runs, {})


def test_a_different_token_names_prompt_position_and_tokens():
    expected = [[5, 6, 7, 8], [10, 11, 12, 13]]
    actual = [[5, 6, 7, 8], [10, 11, 99, 13]]
    assert token_difference(expected, actual) == ("prompt 1: first difference at generated position 2: token 99, "
                                                  "expected 12 (4 tokens, expected 4)")
    with pytest.raises(BenchmarkError, match=r"^gamma 3: prompt 1: first difference at generated position 2: "
                                             r"token 99, expected 12"):
        check_same_tokens("gamma 3", expected, actual)


def test_the_first_differing_prompt_and_position_are_named():
    expected = [[1, 2, 3], [4, 5, 6]]
    actual = [[1, 7, 8], [9, 5, 6]]
    assert token_difference(expected, actual).startswith("prompt 0: first difference at generated position 1: "
                                                         "token 7, expected 2")


def test_a_shorter_or_longer_output_differs():
    assert token_difference([[1, 2, 3]], [[1, 2]]) == ("prompt 0: first difference at generated position 2: "
                                                       "token end of output, expected 3 (2 tokens, expected 3)")
    assert token_difference([[1, 2]], [[1, 2, 3]]) == ("prompt 0: first difference at generated position 2: "
                                                       "token 3, expected end of output (3 tokens, expected 2)")
    with pytest.raises(BenchmarkError, match="end of output"):
        check_same_tokens("truncated", [[1, 2, 3]], [[1, 2]])


def test_a_missing_prompt_differs():
    assert token_difference([[1], [2]], [[1]]) == "1 outputs, expected 2 (one per prompt)"
    with pytest.raises(BenchmarkError, match="1 outputs, expected 2"):
        check_same_tokens("dropped a prompt", [[1], [2]], [[1]])


def test_tuples_and_lists_compare_by_value():
    check_same_tokens("a tuple run", [[1, 2]], [(1, 2)])  # ids from protobuf repeated fields are not lists


def test_runs_match_lists_every_differing_run_and_only_those():
    expected = [[1, 2, 3]]
    with pytest.raises(BenchmarkError) as error:
        check_runs_match("speculative output", "plain decoding (gamma 0)", expected,
                         {"gamma 1": [[1, 2, 3]], "gamma 2": [[1, 5, 3]], "gamma 4": [[0, 2, 3]]})
    message = str(error.value)
    assert message.startswith("speculative output differs from plain decoding (gamma 0):")
    assert "gamma 2: prompt 0: first difference at generated position 1: token 5, expected 2" in message
    assert "gamma 4: prompt 0: first difference at generated position 0: token 0, expected 1" in message
    assert "gamma 1" not in message


def test_checks_still_fail_under_python_O():
    """`python -O` strips bare asserts (the control below shows it did); the checks still raise."""
    script = textwrap.dedent("""
        import sys
        assert False, "not stripped"  # stripped under -O: reaching the next line proves -O is on
        from tools.bench.checks import BenchmarkError, check_runs_match, check_same_tokens, require
        caught = []
        for check in (lambda: require(False, "counts"),
                      lambda: check_same_tokens("gamma 2", [[1, 2, 3]], [[1, 9, 3]]),
                      lambda: check_runs_match("out", "plain", [[1]], {"gamma 2": [[2]]})):
            try:
                check()
            except BenchmarkError as exc:
                caught.append(str(exc).splitlines()[-1].strip())
        print(sys.flags.optimize, caught)
        check_same_tokens("gamma 2", [[1, 2, 3]], [[1, 9, 3]])
    """)
    result = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.startswith("1 ['counts', 'gamma 2: prompt 0: first difference at generated position 1: "
                                    "token 9, expected 2 (3 tokens, expected 3)', 'gamma 2: prompt 0: "), \
        result.stdout + result.stderr
    assert result.returncode == 1
    assert result.stderr.rstrip().splitlines()[-1] == (
        "tools.bench.checks.BenchmarkError: gamma 2: prompt 0: first difference at generated position 1: "
        "token 9, expected 2 (3 tokens, expected 3)")


# The benchmarks themselves: a sweep whose speculative tokens differ from plain decoding stops the run.

class _FakeStack:
    gateway_address = "fake:0"
    metrics_addresses = {"target": "fake-metrics:0"}  # the fake sweep reads nothing from it

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fake_models(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(label="fake", target=tmp_path / "target", draft=tmp_path / "draft", dtype="float32",
                           gguf=None, weights="auto", chat=False, prompt_set="draft",
                           require_draft=lambda: tmp_path / "draft",
                           feature_draft=False, assistant=tmp_path / "draft",
                           prompts=lambda n: [[1, 2, 3]] * n, proposer="model", proposer_label="our draft",
                           proposing={"proposer": "model", "ngram_max": 4, "ngram_min": 1})


PLAIN = [[10, 11, 12], [20, 21, 22]]
CHANGED = [[10, 11, 12], [20, 77, 22]]  # prompt 1, position 1


def _fake_sweep(outputs: dict[int, list[list[int]]]):
    def sweep(address, prompts, gammas, max_new_tokens, temperature=0.0, progress=None, metrics=None, rounds=1,
              routes=None):
        if progress is not None:
            progress.update(rounds * len(gammas) * len(prompts))  # one generation per (round, γ, prompt), as the real sweep
        # "auto" (the γ controller) answers as plain decoding does unless told otherwise; "auto plain"
        # (bench sampling's own stack for auto) is plain decoding.
        return {g: {"token_ids": outputs.get(g, outputs[0]),
                    "tokens_per_s": 10.0 + g if isinstance(g, int) else 11.0 if g == "auto" else 5.5, "seconds": 1.0,
                    "passes": 6, "alpha": 0.5 if d else None, "accepted_fraction": 0.5 if d else None,
                    "mean_accepted_length": 1.5 if d else None, "proposed": 4 if d else 0,
                    "drafting_passes": 2 if d else 0} for g in gammas for d in [g not in (0, "auto plain")]}
    return sweep


COSTS = {"c": 0.1, "weights": "dense", "target_step_ms": 1.0, "draft_step_ms": 0.1, "target_verify_ms": {g: 1.2 for g in range(9)}}


def _patch_stack(monkeypatch, module) -> None:
    monkeypatch.setattr(module, "Stack", _FakeStack)
    monkeypatch.setattr(module, "StackSpec", lambda *a, **k: None)
    monkeypatch.setattr(module, "measure_costs", lambda *a, **k: COSTS)


def test_latency_stops_when_a_gamma_changes_the_output(monkeypatch, tmp_path):
    from tools.bench import latency

    _patch_stack(monkeypatch, latency)
    monkeypatch.setattr(latency, "sweep", _fake_sweep({0: PLAIN, 2: PLAIN, 4: CHANGED}))
    with pytest.raises(BenchmarkError, match=r"gamma 4: prompt 1: first difference at generated position 1: "
                                             r"token 77, expected 21") as error:
        latency.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3, gammas=[0, 2, 4])
    assert "gamma 2" not in str(error.value)
    assert "gamma 4, draft colocated: prompt 1" in str(error.value)  # the colocated sweep is checked too
    assert not (tmp_path / "latency.json").exists()


def test_latency_checks_the_gamma_controller_too(monkeypatch, tmp_path):
    from tools.bench import latency

    _patch_stack(monkeypatch, latency)
    monkeypatch.setattr(latency, "sweep", _fake_sweep({0: PLAIN, 2: PLAIN, "auto": CHANGED}))
    with pytest.raises(BenchmarkError, match=r"\n  auto: prompt 1: first difference at generated position 1") as error:
        latency.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3, gammas=[0, 2])
    assert "gamma 2" not in str(error.value)


def _patch_sampling_sweep(monkeypatch, sampling, outputs: dict[float, dict]) -> None:
    """bench sampling's sweeps answer with ``outputs`` per temperature (_fake_sweep's)."""
    def sweep(address, prompts, gammas, max_new_tokens, temperature, progress, rounds=1, metrics=None, routes=None):
        return _fake_sweep(outputs[temperature])(address, prompts, gammas, max_new_tokens, progress=progress,
                                                 rounds=rounds)

    monkeypatch.setattr(sampling, "sweep", sweep)


def test_sampling_stops_when_a_greedy_gamma_changes_the_output(monkeypatch, tmp_path):
    from tools.bench import sampling

    _patch_stack(monkeypatch, sampling)
    outputs = {0.0: {0: PLAIN, 2: CHANGED}, 1.0: {0: PLAIN, 2: CHANGED}}
    _patch_sampling_sweep(monkeypatch, sampling, outputs)
    with pytest.raises(BenchmarkError, match=r"greedy \(T=0\) .*\n  gamma 2: prompt 1: first difference at "
                                             r"generated position 1: token 77, expected 21"):
        sampling.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3, temperatures=[0.0, 1.0],
                     gammas=[0, 2], with_hf=False)


def test_sampling_checks_the_gamma_controller_at_t0_too(monkeypatch, tmp_path):
    from tools.bench import sampling

    _patch_stack(monkeypatch, sampling)
    outputs = {0.0: {0: PLAIN, 2: PLAIN, "auto": CHANGED}}
    _patch_sampling_sweep(monkeypatch, sampling, outputs)
    with pytest.raises(BenchmarkError, match=r"greedy \(T=0\) .*\n  auto: prompt 1: first difference at "
                                             r"generated position 1") as error:
        sampling.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3, temperatures=[0.0],
                     gammas=[0, 2], with_hf=False, with_trees=False)
    assert "gamma 2" not in str(error.value)


def test_sampling_checks_auto_stacks_own_plain_decoding_at_t0(monkeypatch, tmp_path):
    """The second stack's plain decoding must give the sweep's stack's greedy tokens too."""
    from tools.bench import sampling

    _patch_stack(monkeypatch, sampling)
    outputs = {0.0: {0: PLAIN, 2: PLAIN, "auto plain": CHANGED}}
    _patch_sampling_sweep(monkeypatch, sampling, outputs)
    with pytest.raises(BenchmarkError, match=r"auto's own stack's plain decoding: prompt 1: first difference at "):
        sampling.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3, temperatures=[0.0],
                     gammas=[0, 2], with_hf=False, with_trees=False)


def test_latency_reports_when_every_gamma_matches(monkeypatch, tmp_path):
    from tools.bench import latency

    _patch_stack(monkeypatch, latency)
    monkeypatch.setattr(latency, "sweep", _fake_sweep({0: PLAIN, 2: [list(r) for r in PLAIN]}))
    data = latency.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3, gammas=[0, 2],
                       with_hf=False)
    assert data["best_gamma"] == 2 and (tmp_path / "latency.json").exists()


def test_sampling_does_not_compare_sampled_tokens(monkeypatch, tmp_path):
    """At T > 0 speculative sampling keeps the distribution, not a seed's tokens: different
    tokens there are no error, while T = 0 still has to match."""
    from tools.bench import sampling

    _patch_stack(monkeypatch, sampling)
    outputs = {0.0: {0: PLAIN, 2: PLAIN}, 1.0: {0: PLAIN, 2: CHANGED}}
    _patch_sampling_sweep(monkeypatch, sampling, outputs)
    data = sampling.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3, temperatures=[0.0, 1.0],
                        gammas=[0, 2], with_hf=False)
    assert set(data["temperatures"]) == {0.0, 1.0} and (tmp_path / "sampling.json").exists()
    # speculation=auto's row at each T: its speedup over its own stack's plain decoding (11 against
    # 5.5 tok/s); with auto in the shared stack, over the same T's γ = 0 (11 against 10)
    assert all(entry["auto"]["speedup"] == pytest.approx(2.0) for entry in data["temperatures"].values())
    # auto's own stack's plain decoding: over the sweep's γ = 0 (5.5 against 10), the stacks' gap
    assert all(entry["auto_plain"]["speedup"] == pytest.approx(0.55) for entry in data["temperatures"].values())
    shared = sampling.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3, temperatures=[0.0, 1.0],
                          gammas=[0, 2], with_hf=False, auto_stack="shared")
    assert all(entry["auto"]["speedup"] == pytest.approx(1.1) for entry in shared["temperatures"].values())
    assert all("auto_plain" not in entry for entry in shared["temperatures"].values())
    assert data["temperatures"][1.0]["best_gamma"] == 2  # a fixed γ, never "auto"


def test_synthetic_stops_when_an_alpha_changes_the_output(monkeypatch, tmp_path):
    from tools.bench import synthetic

    _patch_stack(monkeypatch, synthetic)
    monkeypatch.setattr(synthetic, "build_target", lambda path, *a, **k: path)
    monkeypatch.setattr(synthetic, "_params", lambda path: 1_000_000)
    monkeypatch.setattr(synthetic, "read_config", lambda path: SimpleNamespace(vocab_size=300))
    monkeypatch.setattr(synthetic, "sweep", _fake_sweep({0: PLAIN, 2: CHANGED}))
    with pytest.raises(BenchmarkError, match=r"^synthetic alpha 0.5, gamma 2 against plain decoding: prompt 1: "
                                             r"first difference at generated position 1: token 77, expected 21"):
        synthetic.run(tmp_path, alphas=[0.5], gammas=[2], n_prompts=2, max_new_tokens=3)


# Their progress (tools.progress): the total each plans is the work it then does. The fakes
# count one generation per (γ, prompt) as the real sweep does; off a terminal the last line on stderr
# says how far the run got.

def _fake_hf(models, prompts, max_new_tokens, threads=0, temperature=0.0, dtype=None, modes=MODES, progress=None):
    out = {}
    for mode in runnable_modes(models, modes):
        for _ in prompts:
            progress.update()
        out[mode] = {"tokens_per_s": 5.0, "tokens": 3 * len(prompts), "seconds": 1.0, "token_ids": PLAIN,
                     "dtype": dtype or models.dtype, "assistant": "our draft" if mode != "plain" else None}
    return out


def _last_progress(err: str, unit: str = "generations") -> tuple[int, int]:
    """(done, total) of the last progress line on stderr."""
    done, total = re.findall(rf"(\d+)/(\d+) {unit} \(", err)[-1]
    return int(done), int(total)


def test_latency_progress_counts_every_generation_it_plans(monkeypatch, tmp_path, capsys):
    from tools.bench import latency

    _patch_stack(monkeypatch, latency)
    monkeypatch.setattr(latency, "measure_costs", lambda *a, **k: COSTS | {"weights": "int4"})
    monkeypatch.setattr(latency, "sweep", _fake_sweep({0: PLAIN}))
    monkeypatch.setattr(latency, "hf_generate", _fake_hf)
    models = _fake_models(tmp_path)
    models.proposer, models.dtype = "ngram+model", "bfloat16"
    latency.run(models, tmp_path, n_prompts=2, max_new_tokens=3, gammas=[0, 2, 4])
    out, err = capsys.readouterr()
    # 2 prompts x (3 γ through the draft service, auto, 3 γ colocated, the draft model alone, dense
    # weights at γ 0 and the best, HF's 4 modes and its plain float32): 2 x 15
    assert _last_progress(err) == (30, 30)
    assert "latency: Hugging Face transformers" in err and "latency: dense weights" in err  # the phases
    assert "generations" not in out  # the tables' stdout carries no progress
    assert "Hugging Face transformers on the same checkpoints" in out and (tmp_path / "latency.json").exists()


def test_sampling_and_synthetic_progress_reach_their_totals(monkeypatch, tmp_path, capsys):
    from tools.bench import sampling, synthetic

    _patch_stack(monkeypatch, sampling)
    monkeypatch.setattr(sampling, "sweep", _fake_sweep({0: PLAIN}))
    monkeypatch.setattr(sampling, "hf_generate", _fake_hf)
    result = sampling.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3,
                          temperatures=[0.0, 0.7, 1.0], gammas=[0, 2], quiet=True)
    # 2 x (3 T x (2 γ + auto + auto's own plain) + 2 tree stacks x 2 T > 0 x 2 γ + 2 T > 0 x 4 HF modes)
    assert _last_progress(capsys.readouterr().err) == (56, 56)
    sampling.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3, temperatures=[1.5], gammas=[0, 2],
                 quiet=True, with_hf=False, with_trees=False, repeats=3)
    assert _last_progress(capsys.readouterr().err) == (24, 24)  # 2 x 3 rounds x (2 γ + auto + its plain)
    sampling.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3, temperatures=[1.5], gammas=[0, 2],
                 quiet=True, with_hf=False, with_trees=False, auto_stack="shared")
    assert _last_progress(capsys.readouterr().err) == (6, 6)  # 2 x (2 γ + auto), in one stack
    assert set(result["trees"]["rows"]) == {f"T={t}, gamma 2, {b} branches" for t in ("0.7", "1") for b in (1, 3)}

    _patch_stack(monkeypatch, synthetic)
    monkeypatch.setattr(synthetic, "build_target", lambda path, *a, **k: path)
    monkeypatch.setattr(synthetic, "_params", lambda path: 1_000_000)
    monkeypatch.setattr(synthetic, "read_config", lambda path: SimpleNamespace(vocab_size=300))
    monkeypatch.setattr(synthetic, "sweep", _fake_sweep({0: PLAIN}))
    synthetic.run(tmp_path, alphas=[0.5, 0.9], gammas=[2, 4], n_prompts=2, max_new_tokens=3)
    assert _last_progress(capsys.readouterr().err) == (10, 10)  # 2 x (plain + 2 α x 2 γ)


def test_the_benchmarks_stop_under_python_O():
    """The stop tests above, run under `python -O`: the benchmarks' checks are not asserts."""
    result = subprocess.run([sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                             "-k", "stops_when or controller"], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0 and re.search(r"^6 passed", result.stdout, re.M), result.stdout + result.stderr


def test_bench_gamma_keeps_the_rows_it_does_not_measure_of_the_same_configuration(tmp_path):
    import json

    from tools.bench.gamma import _other_rows

    data = {"model": "m", "dtype": "bfloat16", "max_new_tokens": 48, "settings": ["γ=0", "ours"]}
    path = tmp_path / "gamma.json"
    path.write_text(json.dumps({**data, "runs": {"1/code": {"a": 1}, "8/code": {"b": 2}, "32/chat": {"c": 3}}}))
    assert _other_rows(path, data, {"1/code", "1/chat"}) == {"8/code": {"b": 2}, "32/chat": {"c": 3}}
    assert _other_rows(path, data, {"32/mix"}) == {"1/code": {"a": 1}, "8/code": {"b": 2}, "32/chat": {"c": 3}}
    assert _other_rows(path, data, {"1/code", "8/code", "32/chat"}) == {}
    assert _other_rows(path, {**data, "dtype": "float32"}, {"32/mix"}) == {}  # another configuration: start afresh
    assert _other_rows(tmp_path / "absent.json", data, {"32/mix"}) == {}


def test_latency_checks_its_tree_rows_and_puts_them_beside_the_chains(monkeypatch, tmp_path):
    """bench latency's tree stacks (--gamma-policy fixed --tree-branches B) are checked against plain
    decoding like every other sweep, and each row is scored against the chain at its γ."""
    from tools.bench import latency

    _patch_stack(monkeypatch, latency)
    specs: list[dict] = []
    monkeypatch.setattr(latency, "StackSpec", lambda *a, **k: specs.append(k) or k)

    def sweep(address, prompts, gammas, max_new_tokens, temperature=0.0, progress=None, metrics=None):
        tree = specs[-1].get("gamma_policy") == "fixed"
        out = _fake_sweep({0: PLAIN, 2: CHANGED if tree and changed else PLAIN})(
            address, prompts, gammas, max_new_tokens, progress=progress)
        for g in gammas:
            out[g]["branch_tokens"] = 3 if tree and g else 0
        return out

    monkeypatch.setattr(latency, "sweep", sweep)
    changed = True
    with pytest.raises(BenchmarkError, match=r"tree verification \(service, 1 branches\).*\n  gamma 2: prompt 1"):
        latency.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3, gammas=[0, 1, 2, 3],
                    with_hf=False)
    changed = False
    data = latency.run(_fake_models(tmp_path), tmp_path, n_prompts=2, max_new_tokens=3, gammas=[0, 1, 2, 3],
                       with_hf=False)
    rows = data["trees"]["rows"]
    assert set(rows) == {f"{layout}, gamma {g}, {b} branches" for layout in ("service", "colocated")
                         for g in (1, 2, 3) for b in (1, 3)}
    assert all(r["branch_tokens"] == 3 and r["over_chain"] > 0 for r in rows.values())
    tree_stacks = [s for s in specs if s.get("gamma_policy") == "fixed"]
    assert {s["extra_target_args"][-1] for s in tree_stacks} == {"1", "3"}
    assert {s.get("colocate_draft", False) for s in tree_stacks} == {False, True}


def _head_to_head(monkeypatch, tmp_path, auto_ids=PLAIN):
    """bench latency's head-to-head on fakes: ours plain at 100 tok/s and auto at 120 in every
    round; llama.cpp at 80, then 100, then 80; returns (result, the order the turns ran in)."""
    from tools.bench import latency

    order: list[str] = []
    peer_speeds = iter([80.0, 100.0, 80.0])

    def sweep(address, prompts, gammas, max_new_tokens, progress=None, **_):
        order.append("ours")
        speeds = {0: 100.0, "auto": 120.0}
        return {g: {"token_ids": PLAIN if g == 0 else auto_ids, "tokens_per_s": speeds[g], "tokens": speeds[g],
                    "seconds": 1.0} for g in gammas}

    def run_apart(fn, **kwargs):
        order.append("llama.cpp")
        speed = next(peer_speeds)
        return {"plain": {"tokens_per_s": speed, "tokens": speed, "seconds": 1.0}}

    _patch_stack(monkeypatch, latency)
    monkeypatch.setattr(latency, "sweep", sweep)
    monkeypatch.setattr(latency, "run_apart", run_apart)
    from tools.progress import Progress

    with Progress(18, "generations", "test", quiet=True) as progress:
        result = latency.head_to_head(_fake_models(tmp_path), tmp_path / "draft", [[1, 2, 3]] * 2, 3, progress,
                                      rounds=3)
    return result, order


def test_latency_head_to_head_takes_turns_and_pools_the_rounds(monkeypatch, tmp_path):
    result, order = _head_to_head(monkeypatch, tmp_path)
    assert order == ["ours", "llama.cpp", "llama.cpp", "ours", "ours", "llama.cpp"]  # reversed every other round
    assert result["plain_over_llama_cpp_runs"] == pytest.approx([1.25, 1.0, 1.25])
    assert result["plain_over_llama_cpp_median"] == pytest.approx(1.25)
    assert result["plain_over_llama_cpp"] == pytest.approx(300 / 260)  # tokens over seconds of all rounds
    assert result["auto_over_llama_cpp"] == pytest.approx(360 / 260)
    assert "default ÷ llama.cpp" in result["table_markdown"]


def test_latency_head_to_head_stops_when_the_default_changes_the_output(monkeypatch, tmp_path):
    with pytest.raises(BenchmarkError, match=r"auto, round 1: prompt 1: first difference at generated position 1"):
        _head_to_head(monkeypatch, tmp_path, auto_ids=CHANGED)
