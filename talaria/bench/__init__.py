"""`make bench`: throughput and copy-rate benchmarks that print ratios measured in one run."""
