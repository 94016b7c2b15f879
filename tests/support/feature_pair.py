"""A tiny feature draft of the model zoo's target (tests/conftest.py ``feature_pair``), trained for a
few steps on the target's own greedy answers to the tests' prompts, so that guesses are accepted
often but not always."""

from __future__ import annotations

from pathlib import Path

import torch
from tests.support.engine_harness import naive_greedy

from specstream.models.feature_draft import save_feature_draft
from specstream.models.feature_head import FeatureHead
from specstream.models.loader import load_model

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 9], [40, 41], [9, 10, 11, 12, 13, 14]]


def train_feature_pair(model_zoo, out: Path, extra_layers: tuple[int, ...] = ()) -> dict[str, Path]:
    """A tiny feature draft of the zoo's target, trained on its greedy answers to the tests'
    prompts; with ``extra_layers`` it reads those layers too (EAGLE-3's fusion)."""
    from tools.distill.feature import FeatureConfig, _spec, head_loss

    target_dir = model_zoo["target"]
    target = load_model(target_dir)
    H = target.config.hidden_size
    sequences = []
    with torch.no_grad():
        for prompt in PROMPTS:  # the tests' own prompts: a random target's text has nothing to generalise
            tokens = torch.tensor(prompt + naive_greedy(target_dir, prompt, 44))
            cache = target.new_cache(1, len(tokens))
            feats = target.hidden(tokens[None], cache, torch.tensor([cache.alloc()]), torch.tensor([0]),
                                  keep=extra_layers)[0]  # [L, (k + 1) H]
            sequences.append((tokens, feats, len(prompt)))
    torch.manual_seed(0)
    head = FeatureHead(_spec(target.config, target.config.vocab_size, extra_layers))
    head.output_ids.copy_(torch.arange(target.config.vocab_size))
    embed, rows = target.embed.detach(), target.lm_head.detach()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(100):
        opt.zero_grad()
        total, terms = zip(*(head_loss(head, x, x[:, -H:], t, embed, rows, n, FeatureConfig())
                             for t, x, n in sequences))
        (sum(total) / sum(terms)).backward()
        opt.step()
    save_feature_draft(out, "tiny-feature", head, str(target_dir), target_dir,
                       (*extra_layers, target.config.num_layers))
    return {"target": target_dir, "draft": out}
