"""Model families: one file each, registered in worker/models/registry.py."""
