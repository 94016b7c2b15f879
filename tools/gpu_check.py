"""`make gpu-check`: the CUDA path proven in one prepared command, within a GPU machine's ten minutes.

On a machine with CUDA it runs, each step in a process of its own with a time limit (so a crash or
a hang costs that step only, and the rest still run), within `BUDGET_S` of wall time:

1. environment: `nvidia-smi -L`, torch and Triton versions, the device's peak memory bandwidth
   (from its memory clock and bus width) and a measured copy bandwidth;
2. the kernel tests on CUDA (no interpreter): every Triton kernel against its torch reference;
3. the three services on `--device cuda` in bfloat16, a ~1B random-init target built there and the
   synthetic-α draft: speculative greedy = plain greedy on 8 prompts, a γ sweep with `auto`, and
   throughput at 32 slots, static against top-up (tools/bench/device_check.py);
4. `bench kernels` on CUDA: fused against unfused output layer at vocab 32k, 128k and 152k, hidden
   2048 and 4096, rows 1-64, and the fused verification's time against its bandwidth bound;
5. the real SmolLM2 pair, where its GGUF file is installed on that machine (it is ~98 MB: more than
   the tree leaves of the 64 MiB that travel to it, so it is usually skipped, and the summary says so).

Everything goes under $OUT (or --out), packed into four files: summary.md (what was measured and
what was not, at the top, then every step's figures), summary.json, results.tar.gz (each step's
JSON and PNG) and logs.tar.gz (each step's output).

The machine is offline and lacks some of the project's dependencies: they travel as wheels in
.whl/ (`make gpu-wheels` downloads them, for CPython 3.12 on x86-64 Linux), which this script
installs into a private directory before the steps run.

Off CUDA it is a dry run: it imports every step's modules (and fails if one does not import), says
which wheels it would carry and which are missing from .whl/ (without failing on that), checks that
the tree and the wheels fit in what travels, and exits 0 with "no CUDA: dry run".
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
BUDGET_S = 540.0  # the whole check: 9 minutes of a 10-minute command
CARRY_LIMIT = 64 * 2**20  # the tree and the wheels together travel to the GPU machine within this
WHEELS_MEASURED = 10.5e6  # bytes of the carried wheels when last measured (make gpu-wheels), for a dry run without them
# What the GPU machine's image already holds (and what they pull in there): never carried, since a
# carried copy would shadow the image's own build (torch's CUDA build above all).
IMAGE = ("torch", "triton", "transformers", "accelerate", "numpy", "safetensors", "tokenizers", "uvloop",
         "prometheus-client", "pytest", "hypothesis")
# Imported only where OTLP export is configured (specstream/serving/telemetry.py), and only by a gateway
# with an HTTP front (gateway/server.py: FastAPI, uvicorn, pydantic and what they pull in), neither of
# which the check starts: not carried, which leaves the tree room to grow within CARRY_LIMIT.
NOT_CARRIED = ("opentelemetry-exporter-otlp-proto-grpc", "opentelemetry-exporter-otlp-proto-http", "fastapi", "uvicorn",
               "pydantic")
KERNEL_TESTS = ("tests/test_triton_kernels.py", "tests/test_kernels.py")


@dataclass(frozen=True)
class Step:
    name: str
    what: str  # what it measures, for the summary's first lines
    limit_s: float  # its own time limit
    reserve_s: float  # the least time it needs: later steps keep this much of the budget
    modules: tuple[str, ...]  # what it imports (the dry run imports them)
    partial: str = ""  # a JSON file the step writes as it goes: its figures so far, should it not finish


STEPS = (
    Step("environment", "GPU, torch/Triton versions, peak and measured memory bandwidth", 60, 15,
         ("torch",)),
    Step("kernel-tests", "every Triton kernel against its torch reference on CUDA", 200, 60,
         ("pytest", "kernels", "kernels.argmax", "kernels.lm_head", "kernels.nbest", "kernels.sample",
          "kernels.speculative", "kernels.verify", "kernels.random", "kernels.dispatch")),
    Step("stack", "the three services on CUDA in bfloat16 (~1B random target, synthetic draft): speculative = "
         "plain greedy, γ sweep and auto, static vs top-up at n=32", 260, 90,
         ("tools.bench.device_check", "tools.cli", "target_service.server", "draft_service.server",
          "gateway.server", "specstream_client"), "device_check.json"),
    Step("bench-kernels", "fused vs unfused output layer (vocab 32k-152k, hidden 2048/4096, rows 1, 4, 16, 64) and the "
         "fused verification against its bandwidth bound", 200, 45, ("tools.bench.kernels",), "kernels.json"),
    Step("smollm2", "the real SmolLM2 pair on CUDA: speculative = plain greedy, γ sweep", 90, 20,
         ("tools.bench.device_check", "specstream.models.registry")),
)


# ----- the steps (each runs in its own process: `gpu_check.py --step NAME --out DIR`) ----------

def step_environment(out: Path) -> dict:
    import torch

    data: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        data["triton"] = triton.__version__
    except ImportError as exc:
        data["triton"] = f"not importable: {exc}"
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    data["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    data |= {"device": props.name, "memory_gib": props.total_memory / 2**30, "sms": props.multi_processor_count,
             "capability": f"{props.major}.{props.minor}"}
    data["peak_bandwidth_gbs"] = _peak_bandwidth_gbs(device)
    # A copy reads and writes every byte: 2 x the size per copy.
    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    data["copy_bandwidth_gbs"] = 2 * size * 20 / (start.elapsed_time(end) / 1000) / 1e9
    if data["peak_bandwidth_gbs"]:
        data["copy_of_peak"] = data["copy_bandwidth_gbs"] / data["peak_bandwidth_gbs"]
    print(json.dumps(data, indent=2))
    return data


def _peak_bandwidth_gbs(device) -> float | None:
    """2 transfers per memory clock x bus width, from the driver's device attributes (Triton's)."""
    try:
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(device.index or 0)
        return 2 * props["mem_clock_rate"] * 1e3 * props["mem_bus_width"] / 8 / 1e9
    except Exception as exc:  # recorded: the measured copy bandwidth still stands
        print(f"peak bandwidth: not read from the driver ({type(exc).__name__}: {exc})")
        return None


def step_kernel_tests(out: Path) -> dict:
    junit = out / "kernel-tests.xml"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    # Compiling the kernels' variants is most of this step (a [64, 512] tile takes seconds of LLVM
    # each): the machine's cores compile them side by side where pytest-xdist is installed.
    workers = ["-n", "8"] if importlib.util.find_spec("xdist") else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers,
                           f"--junitxml={junit}", *KERNEL_TESTS], cwd=ROOT, env=env)
    counts = _junit_counts(junit)
    print(json.dumps(counts))
    if proc.returncode != 0:
        raise RuntimeError(f"kernel tests: pytest exited {proc.returncode} ({counts})")
    return counts


def _junit_counts(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {"error": "no junit report"}
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {
        "seconds": float(suite.get("time", 0))}


def step_bench_kernels(out: Path) -> dict:
    from tools.bench import kernels

    data = kernels.run(out, "cuda", vocabs=(32_000, 128_256, 151_936), rows=(1, 4, 16, 64),
                       hiddens=(2048, 4096), models=None)
    big = [s for s in data["sizes"] if s["vocab"] >= 128_000 and "fused 1-best + logprob" in s["ms"]]
    if big:
        ratios = [s["ms"]["unfused 1-best + logprob"] / s["ms"]["fused 1-best + logprob"] for s in big]
        data["fused_speedup_vocab_128k_plus"] = {"min": min(ratios), "max": max(ratios),
                                                 "median": sorted(ratios)[len(ratios) // 2]}
    data["verification_of_bound"] = [v["ms"] / v["read bound ms"] for v in data["verification"]]
    data["tables_markdown"] = kernels.tables(data, markdown=True)
    return data


def step_stack(out: Path) -> dict:
    from tools.bench import device_check

    return device_check.run(out, "cuda")


def step_smollm2(out: Path) -> dict:
    from specstream.models.registry import MODELS, PAIRS

    try:
        MODELS["smollm2"].path()
    except Exception as exc:
        return {"skipped": f"the SmolLM2 GGUF file is not installed here ({exc}); at ~98 MB it does not fit in "
                           "the 64 MiB that travel with the tree"}
    from tools.bench import device_check
    from tools.bench.models import BenchModels

    pair = PAIRS["smollm2"]  # its token draft: a feature draft runs on the CPU only
    models = BenchModels.from_refs(pair.target, pair.token_draft or pair.draft, "bfloat16", "smollm2",
                                   weights="dense", proposer=pair.proposer, ngram_min=pair.ngram_min)
    models.device = "cuda"
    return device_check.real_pair(out, models)


RUNNERS = {"environment": step_environment, "kernel-tests": step_kernel_tests, "bench-kernels": step_bench_kernels,
           "stack": step_stack, "smollm2": step_smollm2}


# ----- the driver --------------------------------------------------------------------------------

@dataclass
class Outcome:
    step: str
    status: str  # "ok", "failed", "timed out" or "skipped"
    seconds: float
    detail: str = ""  # why it failed or was skipped
    data: dict = field(default_factory=dict)


def run_steps(steps: tuple[Step, ...], work: Path, budget_s: float, env: dict[str, str],
              command=lambda step, work: [sys.executable, str(Path(__file__).resolve()), "--step", step.name,
                                          "--out", str(work)]) -> list[Outcome]:
    """Runs each step in its own process, logging to work/<name>.log; a step gets its own limit or
    what the budget has left after reserving the later steps' least times, whichever is shorter.
    Its result is what it wrote to work/<name>.json."""
    deadline = time.monotonic() + budget_s
    outcomes = []
    for i, step in enumerate(steps):
        later = sum(s.reserve_s for s in steps[i + 1:])
        limit = min(step.limit_s, deadline - time.monotonic() - later)
        if limit < step.reserve_s / 2:
            outcomes.append(Outcome(step.name, "skipped", 0.0, f"{limit:.0f} s of the budget left"))
            continue
        started = time.monotonic()
        with open(work / f"{step.name}.log", "w") as log:
            log.write(f"$ {' '.join(command(step, work))}\n")
            log.flush()
            try:
                proc = subprocess.run(command(step, work), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=limit)
                status = "ok" if proc.returncode == 0 else "failed"
                detail = "" if status == "ok" else f"exit {proc.returncode}: {_last_line(work / f'{step.name}.log')}"
            except subprocess.TimeoutExpired:
                status, detail = "timed out", f"stopped after {limit:.0f} s"
        result = work / f"{step.name}.json"
        data = json.loads(result.read_text()) if result.exists() else {}
        if not data and step.partial and (work / step.partial).exists():
            data = json.loads((work / step.partial).read_text()) | {"partial": f"{step.partial}, as far as it got"}
        if status == "ok" and "skipped" in data:
            status, detail = "skipped", data["skipped"]
        outcomes.append(Outcome(step.name, status, time.monotonic() - started, detail, data))
        print(f"{step.name}: {status} in {outcomes[-1].seconds:.0f} s {detail}", flush=True)
    return outcomes


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def summary(outcomes: list[Outcome], steps: tuple[Step, ...]) -> str:
    """Markdown: what was measured and what was not first, then each step's figures."""
    what = {s.name: s.what for s in steps}
    measured = [o for o in outcomes if o.status == "ok"]
    missing = [o for o in outcomes if o.status != "ok"]
    env = next((o.data for o in outcomes if o.step == "environment" and o.data), {})
    lines = [f"# make gpu-check on {env.get('device', 'an unnamed device')}", "",
             "Measured: " + ("; ".join(f"{o.step} ({what[o.step]})" for o in measured) or "nothing"),
             "", "Not measured: " + ("; ".join(f"{o.step}: {o.status}, {o.detail}" for o in missing) or "nothing"),
             "", "| step | status | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {o.step} | {o.status} | {o.seconds:.0f} | {o.detail} |" for o in outcomes]
    for o in outcomes:
        if not o.data:
            continue
        lines += ["", f"## {o.step}", ""]
        if o.step == "environment":
            lines += [f"- {k}: {v}" for k, v in o.data.items()]
        elif o.step == "kernel-tests":
            lines.append(", ".join(f"{k} {v}" for k, v in o.data.items()))
        elif o.step == "bench-kernels":
            lines.append(o.data.get("tables_markdown") or _sizes_table(o.data.get("sizes", [])))
            if "fused_speedup_vocab_128k_plus" in o.data:
                lines.append(f"\nfused 1-best speed-up over unfused at vocab ≥ 128k: "
                             f"{json.dumps(o.data['fused_speedup_vocab_128k_plus'])}")
        elif o.step in ("stack", "smollm2"):
            lines += [o.data.get("title", ""), "", o.data.get("exactness", ""), "",
                      o.data.get("latency_table_markdown") or _latency_rows(o.data.get("latency", {})), "",
                      o.data.get("throughput_table_markdown", "")]
        if "partial" in o.data:
            lines += ["", f"(partial: {o.data['partial']})"]
    return "\n".join(lines) + "\n"


def _sizes_table(sizes: list[dict]) -> str:
    """bench kernels' output-layer sizes measured so far, ms per call (a step that did not finish)."""
    if not sizes:
        return ""
    names = list(sizes[0]["ms"])
    rows = [f"| {s['vocab']} | {s['rows']} | {s['hidden']} | " + " | ".join(f"{s['ms'].get(n, float('nan')):.3f}"
                                                                           for n in names) + " |" for s in sizes]
    return "\n".join([f"| vocab | rows | hidden | {' | '.join(n + ' ms' for n in names)} |",
                      "|---" * (3 + len(names)) + "|", *rows])


def _latency_rows(latency: dict) -> str:
    """The stack's latency figures measured so far (a step that did not finish)."""
    return "\n".join(f"- {name}: {r.get('tokens_per_s', 0):.1f} tok/s" + (
        f", {r['speedup']:.2f}x plain, α {r['alpha']}" if "speedup" in r else "") for name, r in latency.items())


def pack(work: Path, out: Path, outcomes: list[Outcome], steps: tuple[Step, ...]) -> list[Path]:
    """The four files that come back: summary.md, summary.json, results.tar.gz, logs.tar.gz."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(summary(outcomes, steps))
    (out / "summary.json").write_text(json.dumps([o.__dict__ for o in outcomes], indent=2, default=str))
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if path.is_file() and path.suffix in (".json", ".png", ".xml"):
                tar.add(path, arcname=str(path.relative_to(work)))
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(work.rglob("*.log")):  # each step's output, and the services' logs of the stack steps
            tar.add(path, arcname=str(path.relative_to(work)))
    return [out / name for name in ("summary.md", "summary.json", "results.tar.gz", "logs.tar.gz")]


def install_wheels(site: Path) -> str:
    """pip-installs .whl/*.whl into `site` (no index, no dependencies); what pip said."""
    wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
    if not wheels:
        return "no wheels in .whl/"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", str(site), *wheels],
                          capture_output=True, text=True)
    return f"pip install of {len(wheels)} wheels: exit {proc.returncode} {proc.stderr.strip()[-500:]}"


# ----- what travels --------------------------------------------------------------------------------

def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def carried_wheels() -> dict[str, str]:
    """{distribution: version} the GPU machine needs beyond its image: the project's and the
    client's dependencies and theirs, stopping at the image's packages (and NOT_CARRIED); versions
    as installed here (what the suite ran with)."""
    from packaging.requirements import Requirement

    roots = []
    for pyproject in (ROOT / "pyproject.toml", ROOT / "client" / "pyproject.toml"):
        roots += [Requirement(r).name for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]
    image = {_normalize(n) for n in (*IMAGE, *NOT_CARRIED)}
    own = {"specstream", "specstream-client"}  # in the tree, on PYTHONPATH
    found: dict[str, str] = {}
    stack = list(roots)
    while stack:
        name = _normalize(stack.pop())
        if name in found or name in image or name in own:
            continue
        dist = importlib.metadata.distribution(name)
        found[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                stack.append(req.name)
    return dict(sorted(found.items()))


def _wheel_name(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return _normalize(name), version


def tree_bytes() -> int:
    """Bytes of the files that travel with the working tree: tracked, and untracked but not ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / p.decode()).stat().st_size for p in listed if p and (ROOT / p.decode()).is_file())


def dry_run(out: Path) -> int:
    print("no CUDA: dry run")
    failures = []
    for step in STEPS:
        for module in step.modules:
            try:
                importlib.import_module(module)
            except Exception as exc:
                failures.append(f"{step.name}: {module}: {type(exc).__name__}: {exc}")
        if step.name not in RUNNERS:
            failures.append(f"{step.name}: no runner")
    print(f"steps: {', '.join(s.name for s in STEPS)}; their modules "
          + ("import" if not failures else "do NOT all import:\n  " + "\n  ".join(failures)))
    wanted = carried_wheels()
    have = dict(_wheel_name(p) for p in WHEELS.glob("*.whl"))
    missing = {n: v for n, v in wanted.items() if have.get(n) != v}
    wheel_bytes = sum(p.stat().st_size for p in WHEELS.glob("*.whl") if _wheel_name(p)[0] in wanted)
    print(f"wheels it would carry ({len(wanted)}): " + ", ".join(f"{n}=={v}" for n, v in wanted.items()))
    print(f"missing from .whl/ ({len(missing)}): " + (", ".join(f"{n}=={v}" for n, v in missing.items()) or "none")
          + ("  (make gpu-wheels downloads them)" if missing else ""))
    tree = tree_bytes()
    # Without the wheels here, their size when last downloaded stands in for them.
    carried = wheel_bytes if not missing else WHEELS_MEASURED
    fits = tree + carried <= CARRY_LIMIT
    print(f"travels: tree {tree / 2**20:.1f} MiB + wheels {carried / 2**20:.1f} MiB"
          f"{'' if not missing else ' (as last measured)'} = {(tree + carried) / 2**20:.1f} MiB of "
          f"{CARRY_LIMIT / 2**20:.0f} MiB" + ("" if fits else ": TOO LARGE, the check could not travel"))
    if not fits:
        failures.append(f"tree + wheels {(tree + carried) / 2**20:.1f} MiB > {CARRY_LIMIT / 2**20:.0f} MiB")
    out.mkdir(parents=True, exist_ok=True)
    (out / "dry-run.json").write_text(json.dumps({
        "steps": [s.name for s in STEPS], "import_failures": failures, "wheels": wanted, "missing_wheels": missing,
        "tree_bytes": tree, "wheel_bytes": wheel_bytes, "carry_limit_bytes": CARRY_LIMIT}, indent=2))
    return 1 if failures else 0


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out",
                        help="where the packed results go (default: $OUT, else ./gpu-check-out)")
    parser.add_argument("--step", choices=list(RUNNERS), help="run one step in this process (the driver's call)")
    parser.add_argument("--dry-run", action="store_true", help="the dry run, even where there is CUDA")
    parser.add_argument("--wheels", action="store_true", help="print the wheels to carry, one requirement a line")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"wall time for the whole check (default {BUDGET_S:.0f}: 9 minutes of a 10-minute command)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.wheels:
        print("\n".join(f"{n}=={v}" for n, v in carried_wheels().items()))
        return 0
    if args.step:
        out.mkdir(parents=True, exist_ok=True)
        data = RUNNERS[args.step](out)
        (out / f"{args.step}.json").write_text(json.dumps(data, indent=2, default=str))
        return 0
    if args.dry_run or not cuda_available():
        return dry_run(out)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        site, work = Path(tmp) / "site", Path(tmp) / "work"
        work.mkdir()
        note = install_wheels(site)
        print(note, flush=True)
        (work / "wheels.log").write_text(note + "\n")
        paths = [str(site), str(ROOT), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
               "SPECSTREAM_HOME": str(Path(tmp) / "home")}
        outcomes = run_steps(STEPS, work, args.budget_s - (time.monotonic() - started) - 15, env)
        files = pack(work, out, outcomes, STEPS)
    print((out / "summary.md").read_text().split("\n\n")[1], flush=True)
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
