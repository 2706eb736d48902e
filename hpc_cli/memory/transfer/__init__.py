"""The transfer engine: restores (host -> device) and write-through (device -> host) between the
device pools/state slots and the host slabs, batched into strided runs (spec §6.4-6.5, §7.4,
§7.6-7.7, §11.1-11.2; ARCHITECTURE.md §5; docs/memory.md).

One module per idea, imported from where it lives:

* :mod:`~hpc_cli.memory.transfer.records`: batches, CopyOps and Marks, jobs and their tickets,
  completions;
* :mod:`~hpc_cli.memory.transfer.plan`: the DMA plan of a job, in forward-pass stages
  (:func:`~hpc_cli.memory.transfer.plan.layer_order_for_shape`);
* :mod:`~hpc_cli.memory.transfer.kernel_plan`: the copy method and the segment copy kernel's row
  tables, general and from the per-engine block template;
* :mod:`~hpc_cli.memory.transfer.engine`: :class:`TransferEngine`, its streams, submission and
  completion;
* :mod:`~hpc_cli.memory.transfer.fake`: :class:`FakeTransferEngine`, the test double.
"""
