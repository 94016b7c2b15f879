"""Printing tables and writing JSON and PNG plots for the benchmarks, and naming the CPU they ran on."""

from __future__ import annotations

import json
from pathlib import Path

from specstream.serving.compute import cpu_name  # noqa: F401 - every benchmark names its CPU from here


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))


def pyplot(path: Path):
    """matplotlib.pyplot on the Agg backend; None, saying which plot is not drawn, where matplotlib is
    not installed (a GPU machine that carries only the wheels the services need: the JSON beside
    the plot holds its figures, to be drawn elsewhere)."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: {path.name} not drawn (its figures are in the JSON)", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """A plot as a PNG of at most 256 colours: a plot has few colours of its own (its antialiased
    edges make the rest), and the palette file is about a third of the full-colour one, which
    matters for the figures committed beside the docs (they travel with every checkout)."""
    import io

    from PIL import Image  # matplotlib's own dependency

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    Image.open(buffer).convert("RGB").quantize(colors=256).save(path, format="PNG", optimize=True)


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]],
               hline: float | None = None) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    many = len(series) > 4  # the legend goes under the plot, where it hides no line
    fig, ax = plt.subplots(figsize=(6.4, 4.2 + (0.25 * len(series) if many else 0)))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label, linestyle="--" if "theory" in label else "-")
    if hline is not None:
        ax.axhline(hline, color="grey", linewidth=0.8)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if many:
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14))
    else:
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_bars(path: Path, title: str, ylabel: str, bars: dict[str, float]) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.bar(list(bars), list(bars.values()), color=["#4878d0" if "specstream" in k else "#ee854a" for k in bars])
    for i, v in enumerate(bars.values()):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    ax.set(title=title, ylabel=ylabel)
    ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_stacked(path: Path, title: str, ylabel: str, columns: list[str], parts: dict[str, list[float]]) -> None:
    """One stacked bar per column; ``parts`` maps a component to its value in each column."""
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bottom = [0.0] * len(columns)
    for label, values in parts.items():
        ax.bar(columns, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(title=title, ylabel=ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
