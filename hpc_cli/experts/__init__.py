"""The MoE expert tier: experts in host memory, the most-routed of them resident in device slots.

A Qwen3.5-MoE checkpoint of the 35B-A3B class often does not fit a GPU with room for KV. With
``[experts] offload = true`` the routed experts move to (pinned) host memory and an
:class:`~hpc_cli.experts.cache.ExpertCache` of ``slots`` device slots holds a copy of some of
them; each MoE layer then splits every token's routed experts into *resident* ones (computed on
the device from their slots) and *misses* (computed on the host from the host copy), and adds the
two. Router and shared expert stay on the device. The design is ``shared/spec/expert-cache.hpp``
(R4). A cache, not a layer: the model knows only the hook.

* :mod:`~hpc_cli.experts.cache`: slot storage and the residency table, admission, fills, verify;
* :mod:`~hpc_cli.experts.host`: the host copy of each layer's experts, taken off the model;
* :mod:`~hpc_cli.experts.split`: the routed computation (device hits, host misses);
* :mod:`~hpc_cli.experts.tier`: :class:`~hpc_cli.experts.tier.ExpertTier`, admission policies,
  startup fill and verification, stats;
* :mod:`~hpc_cli.experts.trace`: routing traces recorded while serving;
* :mod:`~hpc_cli.experts.hook`: the model hook (``SparseMoE.expert_tier``) and
  :func:`~hpc_cli.experts.hook.expert_stats`;
* :mod:`~hpc_cli.experts.placement`: the slot budget and :func:`attach_expert_tier` from settings.
"""
