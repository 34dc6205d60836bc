"""Detokenizer service: incremental detokenization and stop strings."""
