"""The independent Python sampler (reference.py) against the C++ golden vectors of
tests/unit/server/sampler/sampler_test.cc: both transcribe the documented "feistel1" order, so
agreement checks the documentation as much as either implementation."""

from __future__ import annotations

import reference


def test_golden_vectors_match_the_cpp_tests() -> None:
    assert reference.permutation(100, 42, 0)[:8] == (53, 21, 94, 16, 83, 39, 65, 6)
    assert reference.permutation(10, 3, 0) == (9, 2, 0, 4, 8, 6, 1, 5, 7, 3)
    order = reference.EpochOrder(1000, 1234, 0)
    assert [order[i] for i in range(8)] == [432, 508, 891, 716, 752, 551, 274, 463]
    n = (1 << 40) + 3
    huge = reference.EpochOrder(n, 42, 0)
    assert [huge[i] for i in range(4)] == [847031520438, 491539896703, 104077952822,
                                           504542592838]
    assert [huge[n - 1], huge[n - 2]] == [307362905394, 902955081928]


def test_every_id_once_for_many_sizes() -> None:
    sizes = [1, 2, 3, 5, 7, 13, 97, 1009] + [p + d for k in range(1, 13) for p in [1 << k]
                                             for d in (-1, 0, 1)]
    for n in sizes:
        for seed, epoch in ((0, 0), (42, 1), ((1 << 64) - 1, 1 << 40)):
            assert sorted(reference.permutation(n, seed, epoch)) == list(range(n)), (n, seed)


def test_no_shuffle_is_the_identity() -> None:
    assert reference.permutation(50, 99, 5, shuffle=False) == tuple(range(50))
