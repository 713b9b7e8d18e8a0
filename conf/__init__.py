"""The YAML config groups, installed as the package `jobs._conf` (pyproject's package-dir) for Hydra's `pkg://` path."""
