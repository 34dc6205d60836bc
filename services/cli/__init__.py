"""The program's top: the ``kvmesh`` command, the launcher of ``kvmesh up``, and the
``kvmesh bench`` load generator (``services/cli/bench/``). Nothing below imports it."""
