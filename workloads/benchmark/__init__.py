"""The default trace's full table: every row at its tuned setting, where each session's time
went, the load and quantum sweeps, and the plots."""
