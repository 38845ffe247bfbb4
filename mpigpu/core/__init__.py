"""The ground floor: errors, MPI and CUDA loading, dtypes, ops, array views, settings, private files,
timing and the exact test patterns. Nothing here holds MPI or GPU state of a job."""
