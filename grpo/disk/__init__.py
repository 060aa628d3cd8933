"""What a run keeps on disk: stage files, output folders, checkpoints, provenance, logs."""
