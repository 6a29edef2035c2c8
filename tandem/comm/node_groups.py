"""The ranks by node: :func:`plan_node_groups` (pure), :class:`NodeGroups`
(the process groups it plans) and :func:`node_mesh` (the same as a 2-D
DeviceMesh, for fully_shard inside each node).

# Note [ranks by node]
A collective that crosses a slow link between nodes sends less over it when
it first reduces inside each node, then exchanges across nodes only between
the ranks that hold the same share (ZeRO++'s hierarchical reduction, and
HSDP's two dimensions). That needs two families of groups: the ranks of each
node (``local``), and for each position within a node the ranks at that
position on every node (``cross``). Which node a rank is on is read from the
launcher (``GROUP_RANK``, torchrun's and tandem run's node rank), or else the
host's name, and gathered from every rank, so the groups are right whatever
order the ranks were numbered in. Nodes with different numbers of ranks have
no such groups: None, and the caller reduces flat.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem.comm.group import GroupComm

__all__ = ["NodeGroups", "node_mesh", "plan_node_groups"]


def plan_node_groups(nodes: Sequence[str]) -> tuple[list[list[int]], list[list[int]]] | None:
    """From each rank's node (``nodes[rank]``): the ranks of each node, and the
    ranks at each position within a node across the nodes; None with a single
    node, one rank a node, or nodes of different sizes."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    local = list(by_node.values())
    sizes = {len(ranks) for ranks in local}
    if len(local) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    cross = [[ranks[i] for ranks in local] for i in range(len(local[0]))]
    return local, cross


@dataclass(frozen=True)
class NodeGroups:
    """This rank's two groups: the ranks of its node, and the ranks at its
    position on every node (Note [ranks by node])."""

    local: GroupComm
    cross: GroupComm

    @classmethod
    def build(cls, comm: GroupComm) -> NodeGroups | None:
        """The groups over the default group's ranks (a collective: every rank
        calls it); None where the nodes do not make two dimensions."""
        if comm.group is not None or comm.size < 4:
            return None
        planned = plan_node_groups(_node_of_each_rank(comm))
        if planned is None:
            return None
        local_lists, cross_lists = planned
        mine: dict[str, GroupComm] = {}
        for kind, lists in (("local", local_lists), ("cross", cross_lists)):
            for ranks in lists:  # every rank makes every group, in the same order
                group = dist.new_group(ranks)
                if comm.rank in ranks:
                    mine[kind] = GroupComm(group)
        return cls(mine["local"], mine["cross"])


def _node_of_each_rank(comm: GroupComm) -> list[str]:
    """Each rank's node (Note [ranks by node]): a collective."""
    node = os.environ.get("GROUP_RANK") or socket.gethostname()
    return [str(n) for n in comm.all_gather_object(node, tag="node of each rank")]


def node_mesh(device_type: str = "cpu", *, who: str = "node_mesh") -> Any:
    """The world's ranks as a 2-D ``DeviceMesh`` with dimensions ``("node",
    "local")``: ``mesh["local"]`` the ranks of this rank's node, ``mesh["node"]``
    the ranks at its position on every node. A collective: every rank calls it.
    ``fully_shard(model, mesh=node_mesh("cuda")["local"])`` shards a model over
    each node alone, for DiLoCo across the nodes (``TrainerConfig(diloco=...)``).

    Raises:
        ValueError: on every rank, where the nodes do not make two dimensions
            (one node, one rank a node, or nodes of different sizes), naming
            the ranks of each node; ``who`` says which caller needed them.
    """
    from torch.distributed.device_mesh import DeviceMesh

    comm = GroupComm(None)
    nodes = _node_of_each_rank(comm)
    planned = plan_node_groups(nodes)
    if planned is None:
        by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(nodes):
            by_node.setdefault(node, []).append(rank)
        raise ValueError(
            f"rank {comm.rank}: {who} needs at least 2 nodes of the same number of ranks, 2 or more each "
            f"(the node of each rank is GROUP_RANK, set by tandem run and torchrun, else the host name); "
            f"got ranks by node {by_node}. On one node, or one rank a node, use strategy='ddp'")
    local, _ = planned
    return DeviceMesh(device_type, torch.tensor(local), mesh_dim_names=("node", "local"))
