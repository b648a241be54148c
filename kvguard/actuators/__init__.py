"""Actuators: where kvguard's decisions take effect.

The admission proxy (:mod:`kvguard.actuators.proxy`) in the request path, and the
shared :class:`~kvguard.actuators.mitigations.Mitigations` that the daemon sets from
each decision and that the proxy, ``/admission`` and ``/readyz`` read.
"""
