"""Training over slow links: DiLoCo, LocalSGD and Streaming DiLoCo
(:class:`DiLoCo`, :class:`DiLoCoConfig`)."""

from tandem.diloco.config import DiLoCoConfig
from tandem.comm.node_groups import node_mesh
from tandem.diloco.diloco import DiLoCo

__all__ = ["DiLoCo", "DiLoCoConfig", "node_mesh"]
