"""`specstream bench throughput --fronts grpc,http`, its pure parts: the pass order, pooling passes
into one front's figures, the check that both fronts returned the same completion tokens, the HTTP
front's overhead and its table row, what each front's client sends, the --fronts flag, and the
JSON, tables and plots a run writes. No processes: the stack and the clients are fakes."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from tools.bench import throughput
from tools.bench.checks import BenchmarkError
from tools.bench.throughput import Pass, Setting
from tools.cli import build_parser

SETTING = Setting(4, "topup", 1.0, "all", 0)
REQUESTS = [([1, 2, 3], 4), ([4, 5], 2), ([6], 1), ([7, 8, 9, 10], 3)]


def same(value: float):
    return pytest.approx(value, rel=1e-12, abs=1e-12)


def _pass(front: str, latencies: list[float], seconds: float, tokens=(4, 2, 1, 3), steps: int = 10) -> Pass:
    counters = {"steps": steps, "queued_steps": steps // 2, "queued_rows": 2 * steps, "row_expansions": 3 * steps,
                "tokens_processed": 30, "padded_tokens": 10, "occupancy": [1, 2, 3, 4, steps - 10]}
    return Pass(front, list(zip(tokens, latencies)), seconds, counters)


def test_schedule_alternates_fronts_abba_so_drift_weighs_on_both():
    assert throughput.schedule(("grpc",)) == ["grpc"]  # the old run: one pass
    assert throughput.schedule(("grpc",), 3) == ["grpc"] * 3
    assert throughput.schedule(("http",), 2) == ["http", "http"]
    assert throughput.schedule(("grpc", "http")) == ["grpc", "http", "http", "grpc"]
    order = throughput.schedule(("grpc", "http"), 2)
    assert order == ["grpc", "http", "http", "grpc"] * 2
    # a linear drift: pass k's position sums to the same for both fronts
    assert sum(k for k, f in enumerate(order) if f == "grpc") == sum(k for k, f in enumerate(order) if f == "http")
    assert throughput.schedule(("http", "grpc")) == ["http", "grpc", "grpc", "http"]


def test_summarize_pools_a_fronts_passes():
    passes = [_pass("http", [0.4, 0.2, 0.1, 0.3], 1.0), _pass("http", [0.8, 0.6, 0.5, 0.7], 2.0, steps=20)]
    r = throughput.summarize(SETTING, 8, passes)
    assert r["front"] == "http" and r["passes"] == 2 and r["requests"] == 8 and r["clients"] == 8
    assert r["tokens"] == 20 and r["seconds"] == 3.0
    assert r["tokens_per_s"] == same(20 / 3.0)
    assert r["pass_tokens_per_s"] == [same(10.0), same(5.0)]
    latencies = sorted([0.4, 0.2, 0.1, 0.3, 0.8, 0.6, 0.5, 0.7])
    assert r["p50_s"] == latencies[4] and r["p99_s"] == latencies[7]
    assert r["mean_latency_s"] == same(sum(latencies) / 8) and r["mean_tokens"] == same(20 / 8)
    per_token = sorted(lat / tok for lat, tok in zip([0.4, 0.2, 0.1, 0.3, 0.8, 0.6, 0.5, 0.7], [4, 2, 1, 3] * 2))
    assert r["per_token_p50_s"] == same(per_token[4]) and r["per_token_p99_s"] == same(per_token[7])
    # the target's counters: summed over the passes
    assert r["steps"] == 30 and r["expansions_per_step"] == same(90 / 30)
    assert r["mean_occupancy"] == same(90 / 30 / SETTING.n)
    assert r["occupancy_while_queued"] == same(60 / 15 / SETTING.n)
    assert r["padding_fraction"] == same(20 / 80)
    assert r["occupancy_histogram"] == [2, 4, 6, 8, 10]
    assert r["setting"]["name"] == SETTING.name


def test_summarize_one_pass_keeps_the_old_figures():
    r = throughput.summarize(SETTING, 8, [_pass("grpc", [0.4, 0.2, 0.1, 0.3], 2.0)])
    assert r["tokens_per_s"] == same(10 / 2.0) and r["seconds"] == 2.0 and r["requests"] == 4
    assert r["p50_s"] == 0.3 and r["p99_s"] == 0.4  # index len // 2 and min(len - 1, int(0.99 len)), as before


def test_fronts_must_return_the_same_completion_tokens():
    good = [_pass("grpc", [0.1] * 4, 1.0), _pass("http", [0.2] * 4, 1.0), _pass("http", [0.2] * 4, 1.0)]
    throughput.check_fronts_agree(SETTING.name, REQUESTS, good)
    throughput.check_fronts_agree(SETTING.name, REQUESTS, [])
    bad = good + [_pass("grpc", [0.1] * 4, 1.0, tokens=(4, 1, 1, 3))]
    with pytest.raises(BenchmarkError, match=r"n=4 topup ε=1 all γ=0: 1 requests .* through grpc \(pass 3\) "
                                             r"and grpc \(pass 0\): request 1 \(max_new_tokens 2\): 1 against 2"):
        throughput.check_fronts_agree(SETTING.name, REQUESTS, bad)
    short = good + [Pass("http", [(4, 0.1), (2, 0.1)], 1.0)]
    with pytest.raises(BenchmarkError, match="pass 3 \\(http\\) answered 2 requests"):
        throughput.check_fronts_agree(SETTING.name, REQUESTS, short)
    # With the token ids: the same counts are not enough.
    ids = [[1, 2, 3, 4], [5, 6], [7], [8, 9, 10]]
    agree = [_pass("grpc", [0.1] * 4, 1.0), _pass("http", [0.2] * 4, 1.0)]
    for p in agree:
        p.outputs = [list(i) for i in ids]
    throughput.check_fronts_agree(SETTING.name, REQUESTS, agree)
    agree[1].outputs[2] = [70]
    with pytest.raises(BenchmarkError, match=r"1 requests got other completion tokens through http \(pass 1\) "
                                             r"than through grpc \(pass 0\), greedy: requests 2"):
        throughput.check_fronts_agree(SETTING.name, REQUESTS, agree)


def test_front_overhead_and_its_row():
    grpc = {"tokens_per_s": 100.0, "p50_s": 1.0, "p99_s": 3.0, "per_token_p50_s": 0.10, "per_token_p99_s": 0.50,
            "mean_latency_s": 1.2, "mean_tokens": 12.0}
    http = {"tokens_per_s": 96.0, "p50_s": 1.05, "p99_s": 3.2, "per_token_p50_s": 0.104, "per_token_p99_s": 0.52,
            "mean_latency_s": 1.26, "mean_tokens": 12.0}
    o = throughput.front_overhead(grpc, http, [100.0, 100.0, 90.0, 110.0], [96.0, 96.0, 100.0, 100.0])
    assert o["tokens_per_s_ratio"] == same(0.96) and o["meets_target"] is True
    assert o["request_p50_ms"] == same(50.0) and o["request_p99_ms"] == same(200.0)
    assert o["token_p50_ms"] == same(4.0) and o["token_p99_ms"] == same(20.0)
    assert o["mean_ms_per_token"] == same(60.0 / 12)
    # per round: the rate pooled over its two passes (equal token counts: the harmonic mean)
    assert o["round_ratios"] == [same(0.96), same(100.0 / (2 / (1 / 90 + 1 / 110)))]
    assert throughput.front_overhead(grpc, dict(http, tokens_per_s=94.9))["meets_target"] is False
    assert throughput.front_overhead(grpc, http)["round_ratios"] == []

    row = throughput.front_row("short", SETTING, grpc, http, o)
    assert len(row) == len(throughput.FRONT_HEADERS)
    assert row[:6] == ["short", SETTING.name, 100.0, 96.0, o["tokens_per_s_ratio"], "yes"]
    assert row[6:] == [o["request_p50_ms"], o["request_p99_ms"], o["token_p50_ms"], o["token_p99_ms"],
                       o["mean_ms_per_token"]]


def test_row_names_show_the_front_only_when_not_grpc_alone():
    assert throughput.row_name(SETTING, "grpc", ("grpc",)) == SETTING.name
    assert throughput.row_name(SETTING, "grpc", ("grpc", "http")) == f"{SETTING.name} grpc"
    assert throughput.row_name(SETTING, "http", ("grpc", "http")) == f"{SETTING.name} http"
    assert throughput.row_name(SETTING, "http", ("http",)) == f"{SETTING.name} http"


class _FakeOpenAI:
    """What `openai.AsyncOpenAI` is used for: models.list() and completions.create()."""

    made: list[dict] = []
    calls: list[dict] = []

    def __init__(self, **kwargs) -> None:
        _FakeOpenAI.made.append(kwargs)
        self.models = SimpleNamespace(list=self._models)
        self.completions = SimpleNamespace(create=self._create)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        pass

    async def _models(self):
        return SimpleNamespace(data=[SimpleNamespace(id="the-model")])

    async def _create(self, **kwargs):
        _FakeOpenAI.calls.append(kwargs)
        await asyncio.sleep(0.001 * kwargs["max_tokens"])  # the long ones finish last
        ids = [sum(kwargs["prompt"]) + k for k in range(kwargs["max_tokens"])]  # what the request alone decides
        return SimpleNamespace(choices=[SimpleNamespace(model_extra={"token_ids": ids})])


class _FakeGrpcClient:
    made: list[tuple] = []
    calls: list[tuple] = []

    def __init__(self, address: str, **kwargs) -> None:
        _FakeGrpcClient.made.append((address, kwargs))

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        pass

    async def generate(self, prompt, **options):
        _FakeGrpcClient.calls.append((prompt, options))
        await asyncio.sleep(0.001 * options["max_new_tokens"])
        return SimpleNamespace(token_ids=[sum(prompt) + k for k in range(options["max_new_tokens"])])


def test_each_front_sends_the_same_request_and_results_come_in_request_order(monkeypatch):
    import openai

    import specstream_client

    monkeypatch.setattr(openai, "AsyncOpenAI", _FakeOpenAI)
    monkeypatch.setattr(specstream_client, "AsyncClient", _FakeGrpcClient)
    _FakeOpenAI.made, _FakeOpenAI.calls, _FakeGrpcClient.made, _FakeGrpcClient.calls = [], [], [], []

    http, http_wall, http_ids = asyncio.run(throughput._closed_loop("http", "127.0.0.1:8000", REQUESTS, 2))
    grpc, grpc_wall, grpc_ids = asyncio.run(throughput._closed_loop("grpc", "127.0.0.1:50051", REQUESTS, 2))
    assert [t for t, _ in http] == [t for t, _ in grpc] == [b for _, b in REQUESTS]  # request order
    assert http_ids == grpc_ids == [[sum(p) + k for k in range(b)] for p, b in REQUESTS]
    assert all(latency > 0 for _, latency in http + grpc) and http_wall > 0 and grpc_wall > 0
    assert _FakeOpenAI.made == [{"base_url": "http://127.0.0.1:8000/v1", "api_key": "none", "max_retries": 0,
                                 "timeout": 600}]
    assert sorted(_FakeOpenAI.calls, key=lambda c: c["prompt"]) == [
        {"model": "the-model", "prompt": prompt, "max_tokens": budget, "temperature": 0,
         "extra_body": {"ignore_eos": True, "return_token_ids": True}} for prompt, budget in REQUESTS]
    assert _FakeGrpcClient.made == [("127.0.0.1:50051", {"timeout": 600})]
    # the gRPC client's default temperature is 0, as the HTTP calls send
    assert sorted(_FakeGrpcClient.calls) == [(prompt, {"max_new_tokens": budget, "ignore_eos": True})
                                             for prompt, budget in REQUESTS]
    from specstream_client import GenerateOptions

    assert GenerateOptions().temperature == 0.0
    with pytest.raises(ValueError, match="front 'websocket'"):
        asyncio.run(throughput._closed_loop("websocket", "x", REQUESTS, 1))


def test_fronts_flag():
    parse = lambda *argv: build_parser().parse_args(["bench", "throughput", *argv])  # noqa: E731
    assert parse().fronts == ("grpc",)  # default: the old run
    args = parse("--batch-sizes", "32", "--fronts", "grpc,http", "--repeats", "2")
    assert args.fronts == ("grpc", "http") and args.repeats == 2 and args.batch_sizes == "32"
    assert parse("--fronts", "http").fronts == ("http",)
    assert parse("--fronts", " http , grpc ").fronts == ("http", "grpc")
    for bad in ("grpc,rest", "grpc,grpc", "", ","):
        with pytest.raises(SystemExit):
            parse("--fronts", bad)


def test_bench_command_passes_fronts_and_repeats_on(monkeypatch, tmp_path):
    import tools.cli as cli
    import tools.cli.bench as bench_cli

    seen = {}
    monkeypatch.setattr(bench_cli, "bench_models", lambda args: "models")
    monkeypatch.setattr(throughput, "run", lambda models, out, **kw: seen.update(kw, models=models, out=out))
    assert cli.main(["bench", "throughput", "--out", str(tmp_path), "--batch-sizes", "32", "--policies",
                     "topup ε=1 all", "--gammas", "4", "--fronts", "grpc,http", "--repeats", "3"]) == 0
    assert seen["fronts"] == ("grpc", "http") and seen["repeats"] == 3 and seen["count"] == 200
    assert seen["settings"] == [Setting(32, "topup", 1.0, "all", 4)]


def test_run_writes_the_fronts_table_json_and_plots(monkeypatch, tmp_path, capsys):
    settings = [Setting(4, "static", 1.0, "all", 0), SETTING]

    def measure(models, setting, requests, fronts, repeats, progress):
        progress.update(throughput.requests_sent(setting, len(requests), fronts, repeats))
        order = throughput.schedule(fronts, repeats)
        passes = [_pass(f, [0.1 + (0.05 if f == "http" else 0.0)] * 4,
                        1.0 + (0.02 if f == "http" else 0.0) + (0.5 if setting.policy == "static" else 0.0))
                  for f in order]
        throughput.check_fronts_agree(setting.name, requests, passes)
        out = {f: throughput.summarize(setting, 8, [p for p in passes if p.front == f]) for f in fronts}
        for f in fronts:
            out[f]["latencies_s"] = [r[1] for p in passes if p.front == f for r in p.results]
            out[f]["tokens_per_request"] = [r[0] for r in next(p for p in passes if p.front == f).results]
        return out

    monkeypatch.setattr(throughput, "measure", measure)
    monkeypatch.setattr(throughput, "workload", lambda models, kind, count: REQUESTS)
    models = SimpleNamespace(label="fake", target=None, draft=None, dtype="float32", proposing={})
    data = throughput.run(models, tmp_path, ["short"], settings, count=4, fronts=("grpc", "http"), repeats=2)

    written = json.loads((tmp_path / "throughput.json").read_text())
    assert written["fronts"] == ["grpc", "http"] and written["repeats"] == 2
    assert written["pass_order"] == ["grpc", "http", "http", "grpc"] * 2
    assert [(r["setting"]["name"], r["front"]) for r in written["runs"]] == [
        (s.name, f) for s in settings for f in ("grpc", "http")]
    by = {(r["setting"]["name"], r["front"]): r for r in written["runs"]}
    topup_http = by[(SETTING.name, "http")]
    assert topup_http["over_static"] == same(topup_http["tokens_per_s"]
                                             / by[(settings[0].name, "http")]["tokens_per_s"])
    overhead = {o["setting"]: o for o in written["front_overhead"]}
    ratio = topup_http["tokens_per_s"] / by[(SETTING.name, "grpc")]["tokens_per_s"]
    assert overhead[SETTING.name]["tokens_per_s_ratio"] == same(ratio) == same(1.0 / 1.02)
    assert overhead[SETTING.name]["meets_target"] is True and len(overhead[SETTING.name]["round_ratios"]) == 2
    assert overhead[SETTING.name]["request_p50_ms"] == same(50.0)
    assert written["http_target"] == throughput.HTTP_TARGET
    table = written["front_table_markdown"].splitlines()
    assert table[0] == "| " + " | ".join(throughput.FRONT_HEADERS) + " |" and len(table) == 2 + len(settings)
    assert f"| short | {SETTING.name} | " in table[3]
    assert f"| {SETTING.name} http |" in written["table_markdown"]
    assert data["front_overhead"] == written["front_overhead"]
    printed = capsys.readouterr().out
    assert "HTTP front against gRPC" in printed and "http ÷ grpc" in printed
    for png in ("throughput_occupancy.png", "throughput_fronts.png"):
        assert (tmp_path / png).stat().st_size > 1000, png


def test_run_with_grpc_alone_writes_what_it_always_did(monkeypatch, tmp_path):
    def measure(models, setting, requests, fronts, repeats, progress):
        assert fronts == ("grpc",) and repeats == 1 and progress is not None
        return {"grpc": throughput.summarize(setting, 8, [_pass("grpc", [0.1, 0.2, 0.3, 0.4], 1.0)])}

    monkeypatch.setattr(throughput, "measure", measure)
    monkeypatch.setattr(throughput, "workload", lambda models, kind, count: REQUESTS)
    models = SimpleNamespace(label="fake", target=None, draft=None, dtype="float32", proposing={})
    data = throughput.run(models, tmp_path, ["short"], [SETTING], count=4)
    assert "fronts" not in data and "front_overhead" not in data and not (tmp_path / "throughput_fronts.png").exists()
    assert data["runs"][0]["setting"]["name"] == SETTING.name and data["runs"][0]["tokens"] == 10
    assert f"| short | {SETTING.name} | 10.0 |" in data["table_markdown"]
