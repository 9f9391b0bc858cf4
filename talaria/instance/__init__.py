"""The instance runtime: one engine and the admission loop that decides what it does next.

``Instance`` (admission.py) runs the loop: per-model queues, the round scheduler's slots,
switches, staging, admission within a KV budget, engine steps, event delivery. Beside it:
``calls.py`` (a call inside the instance and its event handle), ``sessions.py`` (session
history, KV locations, soft reservations), ``estimates.py`` (time and size estimates),
``rates.py`` (rates learned from what engine operations report), ``executor.py`` (how
engine operations run: a worker thread live, a modelled sleep in simulation),
``state_report.py`` (the report to the router). The decisions themselves live in
``talaria.policies`` and see the instance only through ``talaria.policies.view``.

May import: ``engine`` (its interface), ``talaria.protocol``, ``talaria.policies.config``,
``talaria.policies``. Never ``router`` or ``workloads``.
"""

from talaria.instance.instance import Instance

__all__ = ["Instance"]
