"""The data contracts every service shares: the step, sampling parameters, errors,
finish reasons, the block hash. Plain data and pure functions; no I/O."""
