"""After (or while) a run: status, the dataset card and plots, read from the run directory."""
