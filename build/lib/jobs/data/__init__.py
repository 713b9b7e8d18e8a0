"""Training data: HDF5 token files (a synthetic language, or a corpus tokenized by `python -m jobs.prepare_data`)
and the mesh-independent sampler that turns (seed, step) into the global batch's samples.

Every mesh sees the same global batches (each dp rank takes its slice), which is what makes parity tests
and resharded resumes exact. The data cursor of a run is just its step.
"""

from jobs.data.sampler import BatchSource, global_batch_indices, mixture_indices
from jobs.data.files import FORMAT_VERSION, ensure_dataset, sources_of

__all__ = ["BatchSource", "ensure_dataset", "global_batch_indices", "mixture_indices", "sources_of",
           "FORMAT_VERSION"]
