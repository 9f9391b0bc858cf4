"""Steps a CUDA graph can replay: the host-sync guard that checks a step never waits on the
device (``sync_guard``), and decode steps run in fixed-shape buckets, replayed from graphs
on a GPU (``decode``)."""
