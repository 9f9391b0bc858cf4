"""The scenario suite behind ``make replay``'s headline: its scenarios, runs, per-scenario
tuning of the peers, figures with intervals, capacity at the SLO, and its report."""
