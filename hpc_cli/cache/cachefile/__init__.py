"""The prefix cache file (spec §5.5; format in docs/prefix-cache-file.md). Pure Python.

- :mod:`~hpc_cli.cache.cachefile.format`: the layout, its records (``FileBlock``,
  ``FileSnapshot``, ``Geometry``, ``SavePlan``, ``CacheFile``), encoding a save's header and
  tables (``FileLayout``) and reading and checking them (``open_cache_file``);
- :mod:`~hpc_cli.cache.cachefile.slab_io`: the slab bytes, written (``save_cache_file``), read
  (``read_plan_slabs``) and verified (``verify_slabs``) in large vectored calls, checksummed on a
  helper thread;
- :mod:`~hpc_cli.cache.cachefile.plan`: what a save writes (``export_saveable``) and what a load
  adopts (``density``, ``plan_host_restore``, ``adopt_plan``).

What ``hpc-cli cache inspect`` prints is the CLI's (``hpc_cli/cli/cache_view.py``).
"""
