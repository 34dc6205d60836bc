"""An API request turned into the engine's parameters: validation, structured outputs,
limits, served model names."""
