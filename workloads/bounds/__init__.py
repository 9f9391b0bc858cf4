"""What no policy can beat and what a policy is measured against: the proven lower bound, each
session alone (the isolated row), and the oracle schedule on a shared device."""
