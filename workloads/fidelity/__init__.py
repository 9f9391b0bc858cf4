"""``talaria fidelity``: the simulator checked against the live engine on this machine."""
