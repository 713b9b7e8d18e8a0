"""The sbatch templates, installed as the package `jobs._sbatch` (pyproject's package-dir) for `jobs.sbatch`."""
