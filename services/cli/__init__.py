"""The program's top: the ``kvmesh`` command, the launcher of ``kvmesh up``, model
preparation, and the ``kvmesh bench`` load generator (``services/cli/bench/``)."""
