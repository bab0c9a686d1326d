"""Studies: what one `python -m testbed ...` command runs (`runner.run`), from a typed config: one
point, or a study (`+experiment=NAME`) whose points catalog.py lists, run as a sweep and aggregated."""
