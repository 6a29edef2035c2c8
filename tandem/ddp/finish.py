"""The end of backward: launch what is left, wait for every reduction, agree
whether a gradient was missing anywhere (Note [missing-gradient flag]), and
deliver the averages: to ``param.grad`` (write_back.py) and to a fused
optimizer's step (fused.py).

# Note [missing-gradient flag]
Without find_unused_parameters, a parameter that gets no gradient on one rank
would leave its bucket unlaunched there while the other ranks wait for it: torch
hangs or reports it one iteration late by index. Here, the rank that finds a
gradient missing at the end of backward launches its remaining buckets anyway
(with zeros), and raises a flag: one reserved element after the parameters of
the last bucket, which the reduction sums like any gradient. Every rank reads the
flag after waiting for the last bucket; if any rank raised it, all ranks gather
the missing names (a collective only on this error path) and raise the same
error, naming the parameters and the ranks. The check costs no extra collective.
On a CUDA device the flag is read one step later, at the end of the next
backward, so that the host never waits for the GPU (Note [late flag] in late_flag.py).

# Note [recovered reduction failures]
In an elastic loop (Note [elastic prepare] in tandem/train/prepare_elastic.py) a
peer that dies during backward fails this rank's reduction, and the exception
would leave ``loss.backward()`` in the user's own loop, which cannot catch it
without a try in every script. So the wrapper may carry a ``failure_handler``
(``DistributedDataParallel.set_failure_handler``): when a reduction fails at
the end of backward, the handler is asked whether it recovers from the error (it
records a peer's failure for the optimizer's step, which then drops the step
and regroups); if so, backward returns without delivering averages: the
gradients are left as they are, not to be stepped on, and the reducer is idle.
Anything the handler does not claim is raised as before.
"""

from __future__ import annotations

import time

import torch

from tandem.comm.group import Work
from tandem.ddp.bucket import Bucket
from tandem.ddp.comm_stats import CommStats
from tandem.ddp.grad_bucket import HookWork
from tandem.ddp.readiness import Readiness
from tandem.ddp.reducer_state import StepState
from tandem.ddp.write_back import bind_views, write_back

__all__ = ["FLAGS_TAG", "Finishing"]

FLAGS_TAG = "missing gradients flag"
"""The tag of the flag's own all-reduce, where it cannot travel in the last bucket."""


class Finishing(Readiness):
    """The reducer's fourth layer: the end of backward."""

    def _finish(self) -> None:
        if self.state is not StepState.ARMED:
            return
        if torch.is_grad_enabled():  # backward(create_graph=True): Note [end of backward] in autograd_hooks.py
            with torch.no_grad():
                self._finish()
            return
        self.state = StepState.FINISHING
        context_grads, self._context_grads = self._context_grads, None
        self._used_counts = None
        try:
            self._finish_step()
            if self._rebind:  # after _finish_step: its locals hold views of the buffer
                self.buffer.settle()  # Note [gradients born in their bucket] in write_back.py
            if context_grads is not None:  # Note [distributed autograd] in dist_autograd.py
                context_grads.deliver(self._used_counts, self.comm.size)
        except Exception as e:
            if self.failure_handler is None or not self.failure_handler(e):
                raise
            # Note [recovered reduction failures]: the caller drops this step.
        finally:
            if context_grads is not None:
                context_grads.restore()
            self.state = StepState.IDLE
            self._callback_queued = False

    def _finish_step(self) -> None:
        learning = self._learning_static_graph
        track_used = self._tracks_used
        if learning:
            self._expected_count = list(self._hook_count)
            for i in range(len(self.params)):
                if self._hook_count[i]:
                    self._ready(i)
        missing = [i for b in self.buckets for pos, i in enumerate(b.spec.params) if not b.ready[pos]]
        if missing and not track_used:
            self._missing_flag = 1.0  # Note [missing-gradient flag]
        for i in missing:
            self._mark_unused(i)
        self._launch_complete()
        assert self._next_launch == len(self.buckets), "every bucket is complete and launched"

        if self._serialize_hooks:
            # The last hook may still issue collectives from its callbacks: let it
            # finish before anything else goes on the wire (Note [hook order] in
            # grad_bucket.py).
            last_work = self.buckets[-1].work
            assert isinstance(last_work, HookWork)
            last_work.settle()
        used_work: Work | None = None
        used = None
        if track_used:
            used = torch.tensor(self._locally_used, dtype=torch.int32, device=self.comm.device)
            used_work = self.comm.all_reduce(used, tag="used parameters", async_op=True)
        flag = None
        # A hook reduces only the parameters' region, a reduce-scatter leaves the
        # flag on one rank (Note [zero reduction] in launch.py): the flag travels alone.
        flag_alone = self._comm_hook is not None or self._zero
        if flag_alone and self._check is None:
            # torch.full fills on the device: no copy from the host, which waits on CUDA.
            flag = torch.full((1,), self._missing_flag, device=self.comm.device)
            self.comm.all_reduce(flag, tag=FLAGS_TAG)
        # Note [fused step] in fused.py: step each bucket as soon as it lands, unless
        # a decision needs every bucket first (dropping the step, the used map).
        stepper = self._stepper
        pipelined = stepper is not None and self._check is None and used_work is None
        if stepper is not None and pipelined:
            stepper.begin_step()
        waited = 0.0
        for bucket in self.buckets:
            started = time.perf_counter()
            bucket.wait()
            waited += time.perf_counter() - started
            if pipelined:
                self._deliver(bucket, None)
        if used_work is not None:
            started = time.perf_counter()
            used_work.wait()
            waited += time.perf_counter() - started
        self.last_stats = CommStats(self._bytes, waited)
        nonfinite = False
        if self._check is not None:
            flag, nonfinite = self._check.agree(flag_alone, self._missing_flag)
        if flag is None:
            last = self.buckets[-1]
            flag = last.data[last.spec.numel]
        if isinstance(flag, torch.Tensor) and flag.is_cuda:  # Note [late flag] in late_flag.py
            late = self._late_flag.take()  # the previous backward's
            self._late_flag.post(flag, [self.names[i] for i in missing])
            if late is not None:
                self._raise_missing(late, late=True)
        elif float(flag) > 0:
            self._raise_missing([self.names[i] for i in missing])

        globally_used = None if used is None else used.tolist()
        if learning:
            self._static_used = globally_used
        elif self.options.static_graph:
            globally_used = self._static_used
        self._used_counts = globally_used  # ranks per parameter (all-reduced with SUM)
        if self.steps == 0 and self.options.rebuild_buckets and not (
                self.options.find_unused_parameters and not self.options.static_graph):
            self._rebuild_pending = True
        if nonfinite:
            assert self._check is not None
            self._check.handle()  # raises, or drops this step's gradients on every rank
            return
        if not pipelined:
            if stepper is not None:
                stepper.begin_step()
            for bucket in self.buckets:
                self._deliver(bucket, globally_used)
        if stepper is not None:
            stepper.end_step()
        if self._zero:  # Note [zero reduction] in launch.py
            if self.options.zero_stage >= 2:
                for p in self.params:
                    p.grad = None
            self.buffer.release()
        self.steps += 1

    def _deliver(self, bucket: Bucket, globally_used: list[int] | None) -> None:
        """Hand a reduced bucket over: its averaged gradients to param.grad (not
        under ZeRO, Note [zero reduction] in launch.py), and to the fused optimizer's step."""
        if not self._zero:
            self._write_back(bucket, globally_used)
        if self._stepper is not None:
            self._stepper.step_bucket(bucket)

    def _write_back(self, bucket: Bucket, globally_used: list[int] | None) -> None:
        if bucket.in_place:
            return  # param.grad holds the average already (Note [in-place reduction] in launch.py)
        if self._rebind and bucket.bindable:
            bind_views(bucket, self.params, globally_used, self._foreign, self._retired)
            return
        write_back(bucket, self.params, globally_used, as_view=self._as_view, stepper=self._stepper)
