"""ZeroOptimizer's checkpoints: the whole state in torch's per-parameter format
(a collective), a rank's own shard, and committed directories of every rank's
shard, loadable at any world size; the third of ZeroOptimizer's layers
(optimizer.py lists them)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tandem.checkpoint.agree import agree
from tandem.checkpoint.atomic import atomic_save
from tandem.checkpoint.commit import CheckpointError, committed_steps, load_committed, save_committed
from tandem.zero.param_gather import ParamGather
from tandem.zero.state_dict import SHARD_FORMAT, Entry, assemble_state, check_shards, entries_of_run, \
    run_state_from

__all__ = ["ZeroCheckpoints"]

_SHARDS_KIND = "zero-shards"  # the kind of save_sharded's committed checkpoints


class ZeroCheckpoints(ParamGather):
    """ZeroOptimizer's third layer: ``state_dict``, ``sharded_state_dict``, ``save_sharded``
    and their loads."""

    def state_dict(self, *, to: int | None = 0) -> dict[str, Any] | None:  # type: ignore[override]
        """The whole optimizer state in the wrapped torch optimizer's format
        (per-parameter full state tensors keyed by parameter index), consolidated
        from every rank's shard. A collective: call it on every rank.

        Args:
            to: the group rank that receives it; None: every rank.

        Returns:
            The state dict on rank ``to`` (every rank when None), None elsewhere.
        """
        shards = self._comm.all_gather_object(self._local_entries(), tag="optimizer state")
        if to is not None and self._comm.rank != to:
            return None
        return assemble_state(shards, self._groups_for_save(), self._shapes())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict in torch's format (from :meth:`state_dict`, from the
        wrapped torch optimizer, or from a run at another world size): each rank
        keeps its own shard of it. Every rank must pass the whole state dict."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError(
                "the state dict's param groups do not match this optimizer's: "
                f"{[len(s['params']) for s in saved_groups]} vs "
                f"{[len(g['params']) for g in self.param_groups]} parameters per group")
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._sync_hyperparams()
        index = self._param_index()
        state = {int(k): v for k, v in state_dict["state"].items()}
        numels = [p.numel() for p in self._reducer.params]
        self._optim.state.clear()
        for run, master in zip(self._runs, self._masters):
            self._copy_params_into(run, master)
            run_state = run_state_from(run, state, index, numels, master.device)
            if run_state is not None:
                self._optim.state[master] = run_state

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state, without communication: save
        one per rank, in parallel (see :meth:`save_sharded`)."""
        return {"format": SHARD_FORMAT, "rank": self._comm.rank, "world_size": self._comm.size,
                "param_groups": self._groups_for_save(), "shapes": self._shapes(),
                "entries": self._local_entries()}

    def load_sharded_state_dicts(self, shards: list[dict[str, Any]], *,
                                 sources: list[str] | None = None) -> None:
        """Load the :meth:`sharded_state_dict` of every rank of a run, at any world
        size (the shards are reassembled per parameter, then resharded).

        Args:
            sources: where each shard came from (file names), for the errors.

        Raises:
            ValueError: naming the shard and the parameter or state key, when the
                shards are not one complete save that fits this optimizer.
        """
        sources = sources or [f"shard {i}" for i in range(len(shards))]
        check_shards(shards, sources, self._shapes(), self._param_names(),
                     [len(g["params"]) for g in self.param_groups])
        self.load_state_dict(assemble_state([s["entries"] for s in shards], shards[0]["param_groups"],
                                            shards[0]["shapes"]))

    def save_sharded(self, directory: str | os.PathLike[str], *, step: int | None = None,
                     keep: int | None = None) -> Path:
        """Save every rank's shard, each rank its own file, into the committed step
        directory ``directory/step-{step:08d}/`` (Note [committed step directories]
        in tandem/checkpoint/commit.py): a save killed midway is never loaded. A
        collective: call it on every rank.

        Args:
            directory: the directory of step directories.
            step: the step saved (default: one more than the newest committed step,
                or 0); every rank must pass the same.
            keep: keep the newest ``keep`` committed steps (None: all).

        Returns:
            The committed step directory.

        Raises:
            tandem.checkpoint.CheckpointError: on every rank, when a rank failed to
                write or the ranks passed different steps.
        """
        if step is None:
            steps = committed_steps(directory)
            step = steps[-1] + 1 if steps else 0

        def write(step_dir: Path) -> list[str]:
            name = f"zero-shard-{self._comm.rank}-of-{self._comm.size}.pt"
            atomic_save(self.sharded_state_dict(), step_dir / name)
            return [name]

        return save_committed(directory, step, write, kind=_SHARDS_KIND, keep=keep, group=self._comm.group)

    def load_sharded(self, directory: str | os.PathLike[str], *, step: int | None = None) -> int:
        """Load the newest committed shards :meth:`save_sharded` wrote under
        ``directory`` (or ``step``'s), from a run at any world size. A collective.

        Returns:
            The step loaded.

        Raises:
            FileNotFoundError: on every rank, when ``directory`` holds no committed step.
            tandem.checkpoint.CheckpointError: on every rank, naming the file: a
                shard missing, truncated or corrupt.
            ValueError: on every rank, naming the file and the parameter or state
                key: shards that do not fit this optimizer.
        """
        ckpt = load_committed(directory, step=step, kind=_SHARDS_KIND, group=self._comm.group)
        names = sorted(ckpt.files)
        shards: list[dict[str, Any]] = []

        def read_and_check() -> None:
            for name in names:
                shards.append(torch.load(ckpt.path(name), map_location="cpu", weights_only=True))
            try:
                check_shards(shards, [str(ckpt.path(n)) for n in names], self._shapes(), self._param_names(),
                             [len(g["params"]) for g in self.param_groups])
            except ValueError as e:
                raise ValueError(f"rank {self._comm.rank}: {e}") from None

        agree(read_and_check, what=f"reading the shards of {ckpt.directory}", error_type=CheckpointError,
              group=self._comm.group)
        self.load_state_dict(assemble_state([s["entries"] for s in shards], shards[0]["param_groups"],
                                            shards[0]["shapes"]))
        return ckpt.step

    def _param_index(self) -> dict[int, int]:
        """Reducer parameter index -> the torch state-dict index (order of param_groups)."""
        position = {id(p): i for i, p in enumerate(self._reducer.params)}
        flat = [p for g in self.param_groups for p in g["params"]]
        return {position[id(p)]: k for k, p in enumerate(flat)}

    def _param_names(self) -> dict[int, str]:
        """The torch state-dict index -> the parameter's name."""
        return {k: self._reducer.names[i] for i, k in self._param_index().items()}

    def _shapes(self) -> dict[int, tuple[int, ...]]:
        flat = [p for g in self.param_groups for p in g["params"]]
        return {k: tuple(p.shape) for k, p in enumerate(flat)}

    def _groups_for_save(self) -> list[dict[str, Any]]:
        groups, k = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{key: v for key, v in g.items() if key != "params"},
                           "params": list(range(k, k + n))})
            k += n
        return groups

    def _local_entries(self) -> list[Entry]:
        index = self._param_index()
        return [entry for run, master in zip(self._runs, self._masters)
                if self._optim.state.get(master)
                for entry in entries_of_run(run, self._optim.state[master], index)]
