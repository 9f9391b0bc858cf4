"""Replaying traces: the closed-loop driver, the simulated in-process cluster, the systems it
compares, live replays against a running router, and the jobs that run many replays."""
