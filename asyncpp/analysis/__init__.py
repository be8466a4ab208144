"""Planning tools that train nothing: the per-rank memory plan and the dry run."""
