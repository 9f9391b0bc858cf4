"""Admission policies of an instance, one decision per module: the round scheduler,
session-prefill, D2D staging, soft reservations, gap prediction.

Policies are pure functions or small bookkeeping classes. A policy that needs facts about the
instance receives ``talaria.policies.view.InstanceView``, a read-only Protocol the instance
satisfies; policies never import ``talaria.instance``.
"""
