"""The blend and packing rules against Megatron-Core itself.

tests/unit/server/sampler/blend_test.cc checks gpufeed's blend against the vectors under
tests/data/blend/; here those vectors are checked against Megatron-Core's own compiled
build_blending_indices (where megatron-core is installed: its helpers are loaded by path, since
megatron.core's own imports need a recent torch) and against a line-by-line transcription of
helpers.cpp (always). And Megatron's GPTDataset sample index (build_sample_idx) is checked to be
the windows server/sampler/pack.h's concat documents: row i is the tokens [i·L, i·L + L + 1) of
the concatenated documents."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "blend"
sys.path.insert(0, str(DATA))
import make_megatron_vector as vectors  # noqa: E402

VECTORS = ["megatron_0.5_0.3_0.2.txt", "megatron_9_sources.txt"]


def helpers_or_skip():
    helpers = vectors.megatron_helpers()
    if helpers is None:
        pytest.skip("megatron-core is not installed (pip install megatron-core; the vectors' "
                    "transcription check still runs)")
    return helpers


@pytest.mark.parametrize("name", VECTORS)
def test_vector_is_the_transcription_of_helpers_cpp(name):
    weights, dataset_index = vectors.read_vector(str(DATA / name))
    assert len(dataset_index) == 100000
    ours, _ = vectors.transcription(vectors.normalize(weights), len(dataset_index))
    assert np.array_equal(ours, dataset_index)


@pytest.mark.parametrize("name", VECTORS)
def test_vector_is_megatrons_build_blending_indices(name):
    helpers_or_skip()
    weights, dataset_index = vectors.read_vector(str(DATA / name))
    dataset_index_peer, dataset_sample_index = vectors.peer(vectors.normalize(weights),
                                                            len(dataset_index))
    assert np.array_equal(dataset_index_peer, dataset_index)
    # dataset_sample_index is each source's count so far (BlendPick.index).
    counts = np.zeros(len(weights), dtype=np.int64)
    expected = np.zeros(len(dataset_index), dtype=np.int64)
    for t, k in enumerate(dataset_index):
        expected[t] = counts[k]
        counts[k] += 1
    assert np.array_equal(dataset_sample_index, expected)


def test_concat_rows_are_megatrons_sample_index():
    helpers = helpers_or_skip()
    rng = np.random.default_rng(3)
    sizes = np.ceil(rng.lognormal(np.log(300), 1.1, size=400)).astype(np.int32)
    doc_idx = np.arange(len(sizes), dtype=np.int32)
    seq_len = 1024
    total = int(sizes.sum())
    sample_idx = helpers.build_sample_idx(sizes, doc_idx, seq_len, 1, total, True, 1)
    starts = np.concatenate([[0], np.cumsum(sizes.astype(np.int64))])
    rows = (total - 1) // seq_len
    assert len(sample_idx) == rows + 1
    for i, (document, offset) in enumerate(sample_idx):
        # Row i begins at stream position i·L; the last entry is the last row's last token
        # (GPTDataset reads to that offset + 1).
        flat = starts[document] + offset
        assert flat == i * seq_len, (i, document, offset)
