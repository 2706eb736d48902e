"""A test double of :class:`~hpc_cli.memory.transfer.engine.TransferEngine`: jobs are recorded
in order, copied only when told and can be failed, so Filling and pin rules are tested on CPU."""

from __future__ import annotations

from hpc_cli.memory.transfer.engine import TransferEngine
from hpc_cli.memory.transfer.records import Completion, CopyOp, Job


class FakeTransferEngine(TransferEngine):
    """A test double: jobs are recorded, copied only when :meth:`complete` is called, and can be
    failed with :meth:`fail`. ``log`` lists ``("copy", job, stage, tag)``, ``("event", job,
    stage)`` and ``("wait", job, stage)`` in enqueue order. Works on any device (copies run
    synchronously at completion)."""

    fast_plan = False  # the log records CopyOps: always the general plan

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple] = []
        self._complete_ids: set[int] = set()

    def _submit(self, job: Job) -> None:
        for op in job.items:
            if isinstance(op, CopyOp):
                self.log.append(("copy", job.job_id, op.stage, op.tag))
            else:
                self.log.append(("event", job.job_id, op.stage))
                job.events[op.stage] = op
        self._queues[job.kind].append(job)

    def _finished(self, job: Job) -> bool:
        return job.job_id in self._complete_ids

    def _jobs_upto(self, job_id: int) -> list[Job]:
        for q in self._queues.values():
            ids = [j.job_id for j in q]
            if job_id in ids:
                return list(q)[:ids.index(job_id) + 1]
        raise KeyError(f"no pending job {job_id}")

    def complete(self, job_id: int | None = None) -> None:
        """Land job ``job_id`` (and the jobs before it on its stream), or every pending job."""
        jobs = [j for q in self._queues.values() for j in q] if job_id is None else self._jobs_upto(job_id)
        for j in jobs:
            if j.job_id in self._complete_ids:
                continue
            if j.error is None:
                for op in j.items:
                    if isinstance(op, CopyOp):
                        op.run_cpu()
            self._complete_ids.add(j.job_id)

    def fail(self, job_id: int, error: str = "injected transfer fault") -> None:
        """Make job ``job_id`` fail: it copies nothing and poll() reports the error."""
        for j in self._jobs_upto(job_id):
            if j.job_id == job_id:
                j.error = error
        self.complete(job_id)

    def drain(self) -> list[Completion]:
        self.complete()
        return self.poll()

    def _wait(self, job: Job, stage: int | None) -> None:
        self.log.append(("wait", job.job_id, stage))
