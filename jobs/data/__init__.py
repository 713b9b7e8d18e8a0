"""Training data: HDF5 token files (a synthetic language, or a corpus tokenized by `python -m jobs.prepare_data`)
and the mesh-independent sampler that turns a data step into the global batch's samples.

Every mesh sees the same global batches (each dp rank takes its slice), which is what makes parity tests
and resharded resumes exact. The data cursor a checkpoint keeps (jobs/data/cursor.py): the next data step,
the global samples and each source's samples consumed before it, and the files' identity.
"""

from jobs.data.cursor import DataChanged, blend, file_identity
from jobs.data.files import FORMAT_VERSION, ensure_dataset, sources_of
from jobs.data.sampler import BatchSource, global_batch_indices, mixture_indices

__all__ = [
    "BatchSource",
    "DataChanged",
    "blend",
    "file_identity",
    "ensure_dataset",
    "global_batch_indices",
    "mixture_indices",
    "sources_of",
    "FORMAT_VERSION",
]
