"""rrfp-run's token-mode data (exec/models/data.py make_token_batch): for one seed it builds microbatches of
exactly the sizes rrfp-sim simulates (rrfp.workload.tokens.batch_sizes), deterministically."""

from __future__ import annotations

import pytest
import torch

from rrfp.exec.config import ModelConfig
from rrfp.exec.models.data import TokenBatchError, make_token_batch
from rrfp.plan.sources import make_hint
from rrfp.sim.config import ExperimentConfig
from rrfp.sim.experiment import draw_samples
from rrfp.study.study import Study
from rrfp.workload.lengths import LengthsTable
from rrfp.workload.tokens import TokenWorkload, batch_sizes

WORKLOAD = TokenWorkload(
    lengths=LengthsTable([3, 9, 14], [0, 1, 2]), layers=2, hidden=32, heads=4, microbatch_size=2,
    encoder="first", image_size=16, patch=8,
)  # fmt: skip
MODEL = ModelConfig(kind="multimodal", layers=2, hidden=32, heads=4, seq_len=32, max_images=4)


def test_rrfp_run_builds_the_microbatches_rrfp_sim_simulates() -> None:
    cfg = ExperimentConfig(
        study=Study(pp=2, microbatches=5, hints=("1f1b",), policies=("fixed",), iterations=2, seed=4),
        seeds=1,
        workload=WORKLOAD,
    )
    samples = draw_samples(cfg, make_hint("1f1b", 2, 5), 0)
    for k in range(2):
        batch = make_token_batch(MODEL, batch_sizes(WORKLOAD, 4, 0, k, 5), 4, 0, k)
        sim = samples[k][0][0]
        assert [mb.tokens.shape[1] for mb in batch] == sim.tokens.tolist()
        assert [mb.num_images for mb in batch] == sim.images.astype(int).tolist()
        assert all(torch.equal(mb.labels[:, :-1], mb.tokens[:, 1:]) for mb in batch)
    again = make_token_batch(MODEL, batch_sizes(WORKLOAD, 4, 0, 0, 5), 4, 0, 0)
    first = make_token_batch(MODEL, batch_sizes(WORKLOAD, 4, 0, 0, 5), 4, 0, 0)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(again, first, strict=True))


def test_a_microbatch_longer_than_the_model_is_a_user_error() -> None:
    small = ModelConfig(kind="multimodal", layers=2, hidden=32, heads=4, seq_len=8, positions=8)
    with pytest.raises(TokenBatchError, match=r"decoder tokens, more than the model's 8 positions"):
        make_token_batch(small, batch_sizes(WORKLOAD, 0, 0, 0, 5), 0, 0, 0)
