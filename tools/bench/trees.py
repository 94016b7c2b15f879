"""`bench latency`'s tree rows: the draft's runner-up guesses verified beside its chain.

For each layout (through the draft service, the draft colocated) and each branch budget, a stack
whose targets run ``--gamma-policy fixed --tree-branches B`` (every greedy pass a tree: the chain
of γ and up to B branches) sweeps γ = 0 and the tree γs; each row is a ratio to that same stack's
plain decoding, beside the chain's row of the main sweep at the same γ (its own stack's ratio).
What a tree buys is tokens per pass at the price of positions in the verify forward: the rows say
both (mean accepted length, the engine's target ms per pass) and how many kept tokens came from
branches. Every row's token ids must equal plain decoding's.
"""

from __future__ import annotations

from collections.abc import Callable

from tools.bench import report
from tools.bench.checks import check_runs_match
from tools.progress import Progress

TREE_GAMMAS = [1, 2, 3]
TREE_BRANCHES = [1, 3]
HEADERS = ["layout", "gamma", "branches", "tok/s", "x plain", "x chain", "mean acc len", "chain mean acc len",
           "target ms", "chain target ms", "branch tokens"]
# A stack's sweep: (its StackSpec fields, the γs) -> γ -> figures (latency's sweep on latency's stack).
Sweep = Callable[..., dict]


def planned_generations(n_prompts: int) -> int:
    """The generations ``tree_rows`` makes (warm-ups aside)."""
    return 2 * len(TREE_BRANCHES) * (1 + len(TREE_GAMMAS)) * n_prompts


def tree_rows(swept: Sweep, plain_ids: list[list[int]], chains: dict[str, dict], progress: Progress) -> dict:
    """The tree sweeps: ``swept(gammas, **stack_fields)`` runs one stack's sweep, ``chains`` are the
    main sweeps' results by layout ("service", "colocated": γ -> figures, scored). Returns the
    JSON's "trees" entry (rows and a markdown table) and prints the table."""
    rows, entries = [], {}
    for layout in ("service", "colocated"):
        for branches in TREE_BRANCHES:
            progress.phase(f"latency: trees of {branches} branches, {layout}")
            runs = swept([0, *TREE_GAMMAS], colocate_draft=layout == "colocated", gamma_policy="fixed",
                         extra_target_args=["--tree-branches", str(branches)])
            check_runs_match(f"tree verification ({layout}, {branches} branches)", "plain decoding (gamma 0)",
                             plain_ids, {f"gamma {g}": runs[g]["token_ids"] for g in [0, *TREE_GAMMAS]})
            plain = runs[0]["tokens_per_s"]
            for gamma in TREE_GAMMAS:
                r, chain = runs[gamma], chains[layout][gamma]
                r["speedup"] = r["tokens_per_s"] / plain
                r["over_chain"] = r["speedup"] / chain["speedup"]
                rows.append([layout, gamma, branches, r["tokens_per_s"], r["speedup"], r["over_chain"],
                             r["mean_accepted_length"], chain["mean_accepted_length"], _target_ms(r),
                             _target_ms(chain), r.get("branch_tokens", 0)])
                entries[f"{layout}, gamma {gamma}, {branches} branches"] = \
                    {k: v for k, v in r.items() if k != "token_ids"}
    progress.print("\ntrees: the chain of gamma and up to B of the draft's runner-ups as branches, every greedy "
                   "pass (x plain: the same stack's gamma 0; x chain: over the chain's own x plain)\n"
                   + report.table(HEADERS, rows))
    return {"gammas": TREE_GAMMAS, "branches": TREE_BRANCHES, "rows": entries,
            "table_markdown": report.markdown_table(HEADERS, rows)}


def _target_ms(r: dict) -> float | str:
    parts = r.get("pass_ms")
    return parts["target"] if parts else "-"
