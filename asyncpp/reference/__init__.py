"""The single-process simulator: the reference executor the pipeline must equal."""
