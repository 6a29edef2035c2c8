"""A ZeroOptimizer's state through torch.distributed.checkpoint: every rank saves
its own shard, in parallel, and loads its shard at any world size.

# Note [ZeRO state in DCP]
The state dict handed to DCP has the layout of torch's
``get_state_dict(model, optimizer)`` for an unsharded model: ``{"state": {name:
{key: value}}, "param_groups": [{..., "params": [name, ...]}]}``, keyed by the
parameters' names. An element-wise value (Adam's moments) is a
:class:`~tandem.checkpoint.flat.FlatShard` of the parameter's full shape whose
pieces are views of this rank's run state (Note [shard runs] in optimizer.py),
so the checkpoint holds each moment at the parameter's shape, written piece by
piece by the ranks that own it (Note [flat shards in DCP] in
tandem/checkpoint/flat.py). Per-parameter scalars (Adam's ``step``) are saved by
every rank that owns a piece of the parameter and kept once by DCP's
de-duplication, as are the param groups. Nothing is gathered.

At load each rank allocates its runs' state from the checkpoint's metadata (the
keys, shapes and dtypes saved) and asks DCP for exactly its pieces; DCP reads
the overlapping parts of whatever pieces were saved, at whatever world size.
The run states then go through the wrapped optimizer's own ``load_state_dict``,
which casts them as torch does (``step`` stays on the CPU unless fused or
capturable).

Being in torch's layout, the checkpoint also loads into a fully-sharded or
plain model's optimizer with DCP and ``set_state_dict``, and
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns it into one
file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from tandem.checkpoint.flat import FlatPiece, FlatShard
from tandem.zero.layout import ShardPiece, ShardRun

if TYPE_CHECKING:
    from tandem.zero.optimizer import ZeroOptimizer

__all__ = ["ZeroLoadTarget", "zero_dcp_state", "zero_load_target"]


def zero_dcp_state(opt: ZeroOptimizer) -> dict[str, Any]:
    """This rank's shard of ``opt``'s state, for ``dcp.save`` with tandem's flat
    planners (Note [ZeRO state in DCP]): views, no copy, no communication
    (parameter all-gathers still in flight are waited for)."""
    opt.finish_param_gather()  # the model's parameters are saved beside this
    names, shapes = _names_and_shapes(opt)
    state: dict[str, dict[str, Any]] = {}
    for run, master in opt.shards.pairs():
        run_state = opt.optim.state.get(master)
        if not run_state:
            continue
        for piece in run.pieces:
            param = state.setdefault(names[piece.param], {})
            for key, value in run_state.items():
                if _is_elementwise(value, run.length):
                    shard = param.get(key)
                    if shard is None:
                        shard = param[key] = FlatShard(shapes[piece.param], value.dtype, [])
                    shard.add(FlatPiece(piece.param_start, _piece_view(value, run, piece)))
                else:
                    param.setdefault(key, value)
    return {"state": state, "param_groups": _groups(opt, names)}


@dataclass
class ZeroLoadTarget:
    """What ``dcp.load`` fills for a ZeroOptimizer (:func:`zero_load_target`);
    :meth:`install` then makes it the optimizer's state."""

    opt: ZeroOptimizer
    state: dict[str, Any]
    """The state dict for dcp.load, in the layout of :func:`zero_dcp_state`."""
    buffers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Per run (its index): the element-wise state the FlatShards write into."""

    def install(self) -> None:
        """Check the loaded param groups and load the run states into the wrapped
        optimizer (after the model's parameters are loaded: masters are refreshed).

        Raises:
            ValueError: the saved param groups hold other parameters than ours.
        """
        opt = self.opt
        names, _ = _names_and_shapes(opt)
        saved = [list(g["params"]) for g in self.state["param_groups"]]
        ours = [[names[i] for i in _group_params(opt, g)] for g in range(len(opt.param_groups))]
        if saved != ours:
            raise ValueError(f"the checkpoint's optimizer param groups hold the parameters {saved}, this "
                             f"ZeroOptimizer's {ours}; resume with the optimizer set up as when saving")
        for group, loaded in zip(opt.param_groups, self.state["param_groups"]):
            group.update({k: v for k, v in loaded.items() if k != "params"})
        opt._sync_hyperparams()
        position = {id(p): i for i, p in enumerate(p for g in opt.optim.param_groups for p in g["params"])}
        inner: dict[int, dict[str, Any]] = {}
        for r, (run, master) in enumerate(opt.shards.pairs()):
            opt.shards.copy_params_into(run, master)
            first = self.state["state"].get(names[run.pieces[0].param])
            if not first:  # never stepped when saved
                continue
            inner[position[id(master)]] = {
                key: self.buffers[r][key] if key in self.buffers.get(r, {}) else value
                for key, value in first.items()}
        saved_inner = opt.optim.state_dict()
        opt.optim.load_state_dict({"state": inner, "param_groups": saved_inner["param_groups"]})


def zero_load_target(opt: ZeroOptimizer, saved: Mapping[str, Any], prefix: str = "optim") -> ZeroLoadTarget:
    """The state dict to ``dcp.load`` this rank's shard of a checkpoint of
    :func:`zero_dcp_state` into, at any world size (Note [ZeRO state in DCP]).

    Args:
        saved: the checkpoint's DCP metadata, ``metadata.state_dict_metadata``.
        prefix: the key the optimizer state was saved under.
    """
    names, shapes = _names_and_shapes(opt)
    target = ZeroLoadTarget(opt, {"state": {}, "param_groups": _groups(opt, names)})
    by_param: dict[str, list[tuple[str, Any]]] = {}  # parameter name -> its saved state keys
    here = f"{prefix}.state."
    for flat_key, md in saved.items():
        name, _, key = flat_key[len(here):].rpartition(".")
        if flat_key.startswith(here) and name:
            by_param.setdefault(name, []).append((key, md))
    for r, (run, master) in enumerate(opt.shards.pairs()):
        for piece in run.pieces:
            name = names[piece.param]
            param = target.state["state"].setdefault(name, {})
            for key, md in by_param.get(name, []):
                if isinstance(md, BytesStorageMetadata):
                    param.setdefault(key, None)  # a placeholder DCP replaces
                elif not isinstance(md, TensorStorageMetadata):
                    continue
                elif len(md.size) >= 1 and math.prod(md.size) == math.prod(shapes[piece.param]):
                    buffers = target.buffers.setdefault(r, {})
                    if key not in buffers:
                        buffers[key] = torch.zeros(run.length, dtype=md.properties.dtype, device=master.device)
                    shard = param.get(key)
                    if shard is None:
                        shard = param[key] = FlatShard(shapes[piece.param], buffers[key].dtype, [])
                    shard.add(FlatPiece(piece.param_start, _piece_view(buffers[key], run, piece)))
                else:
                    param.setdefault(key, torch.zeros(md.size, dtype=md.properties.dtype))
    return target


def _names_and_shapes(opt: ZeroOptimizer) -> tuple[list[str], list[torch.Size]]:
    """Each parameter's name and shape, by the reducer's index."""
    reducer = opt._reducer
    return list(reducer.names), [p.shape for p in reducer.params]


def _group_params(opt: ZeroOptimizer, g: int) -> list[int]:
    """The reducer indices of param group ``g``'s parameters, in its order."""
    position = {id(p): i for i, p in enumerate(opt._reducer.params)}
    return [position[id(p)] for p in opt.param_groups[g]["params"]]


def _groups(opt: ZeroOptimizer, names: list[str]) -> list[dict[str, Any]]:
    """The param groups as get_state_dict writes them: parameters by name."""
    return [{**{k: v for k, v in group.items() if k != "params"},
             "params": [names[i] for i in _group_params(opt, g)]}
            for g, group in enumerate(opt.param_groups)]


def _piece_view(value: torch.Tensor, run: ShardRun, piece: ShardPiece) -> torch.Tensor:
    return value.narrow(0, piece.shard_offset - run.start, piece.length)


def _is_elementwise(value: Any, numel: int) -> bool:
    """A state tensor with one value per element of the run (not ``step``)."""
    return torch.is_tensor(value) and value.dim() >= 1 and value.numel() == numel
