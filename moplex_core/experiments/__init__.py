"""Studies and diagnostics from the paper, runnable as `moplex experiment ...`."""
