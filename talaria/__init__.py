"""The Talaria system: what turns engines into a serving system for agent sessions.

- ``instance/``: the instance runtime (admission loop, calls, sessions, estimates, report);
- ``policies/``: the decisions the loop takes (round scheduler, session-prefill, staging,
  reservations, gap prediction), on a read-only view of the instance, and ``config``: the
  policy switches and the ablation ladder;
- ``protocol/``: what the router and the instances agree on (the router imports only this);
- ``serving/``: the instance's HTTP API, its process, and ``talaria serve`` (router +
  supervised instances from one config);
- ``clock``: the virtual-time event loop of simulations; ``bench/``: ``make bench``;
- ``cli``: the ``talaria`` command, the composition root.

May import ``engine`` and ``substrate``; only ``cli`` imports ``router`` and ``workloads``.
"""
