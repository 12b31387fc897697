"""Where the ZeRO-3 ranks meet and which device each takes (mmrl/trainer/worker.py): loopback on
one node, rank 0's node address across nodes; LOCAL_RANK per node on CPU and 0 on CUDA, where
each rank's Ray actor sees only its own GPU. The two-node run is tests/test_multinode.py."""
from __future__ import annotations

import pytest

from mmrl.trainer.worker import LOOPBACK, local_rank, rendezvous_address


def test_ranks_on_rank_0s_node_meet_on_loopback_and_across_nodes_at_its_address() -> None:
    assert rendezvous_address(["a", "a", "a"], node_ip="10.0.0.7") == LOOPBACK
    assert rendezvous_address([], node_ip="10.0.0.7") == LOOPBACK  # a rank built in-process
    assert rendezvous_address(["a", "b"], node_ip="10.0.0.7") == "10.0.0.7"
    assert rendezvous_address(["b", "a", "a"], node_ip="10.0.0.9") == "10.0.0.9"


@pytest.mark.parametrize("nodes, device, expected", [
    (["a", "a"], "cpu", [(0, 2), (1, 2)]),
    (["a", "b", "a", "b"], "cpu", [(0, 2), (0, 2), (1, 2), (1, 2)]),
    (["a", "a", "b"], "cpu", [(0, 2), (1, 2), (0, 1)]),
    # 8 ranks on 8 GPUs of one node: each actor's only visible device is 0 (rank 5 on device 5
    # would be an invalid device ordinal)
    (["a"] * 8, "cuda", [(0, 8)] * 8),
    (["a"] * 4 + ["b"] * 4, "cuda", [(0, 4)] * 8),
])
def test_local_rank_counts_the_ranks_of_each_node(nodes: list[str], device: str,
                                                   expected: list[tuple[int, int]]) -> None:
    assert [local_rank(r, nodes, device) for r in range(len(nodes))] == expected


def test_without_node_ids_a_rank_is_alone_on_its_node() -> None:
    assert local_rank(0, [], "cpu") == (0, 1)
    assert local_rank(0, [], "cuda") == (0, 1)
