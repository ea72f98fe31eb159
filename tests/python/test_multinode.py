"""Several nodes, a gpufeedd each (the multi-node recipe): every rank attaches to its
own node's daemon with its global rank and the job's world size. Two daemons here stand for
two nodes serving ranks {0, 1} and {2, 3} of one job; the ranks see every sample exactly once
per epoch between them, each batch the sampler's, as if one daemon served all four."""

from __future__ import annotations

import numpy as np

import gpufeed
import reference
from conftest import Daemon


def test_two_daemons_serve_one_job_exactly_once(tmp_path, datasets):
    nodes = []
    for name in ("node0", "node1"):
        (tmp_path / name).mkdir()
        nodes.append(Daemon(tmp_path / name))
    try:
        expected = np.load(datasets.records)
        world, batch, seed = 4, 7, 3
        steps = 157 // (world * batch)  # drop_last: 5 steps an epoch, 140 of 157 samples
        seen = {0: [], 1: []}
        for rank in range(world):
            node = nodes[rank // 2]
            with gpufeed.Client(node.socket).attach(datasets.records, kind="records",
                                                    batch_size=batch, seed=seed, rank=rank,
                                                    world_size=world, job="multi-node",
                                                    stop_epoch=2) as s:
                got = 0
                for b in s:
                    ids, valid = reference.rank_slice(157, seed, b.epoch, b.step, rank, world,
                                                      batch)
                    assert b.ids.tolist() == ids and b.valid_count == valid
                    assert np.array_equal(b.numpy()["data"], expected[ids])
                    seen[b.epoch] += ids
                    got += 1
                assert got == 2 * steps
        for epoch in (0, 1):
            assert len(seen[epoch]) == len(set(seen[epoch])) == world * batch * steps, epoch
            order = reference.EpochOrder(157, seed, epoch, True)
            assert set(seen[epoch]) == {order[i] for i in range(world * batch * steps)}
    finally:
        for n in nodes:
            n.stop()
