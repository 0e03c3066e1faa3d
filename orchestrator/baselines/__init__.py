"""Baseline policies the proposed method is compared against, behind the simulator's `DispatchPolicy` interface.

load_balancing (JSQ, JIQ, SED, SA-JSQ), petals, bprr, parallax, helix, jffc ("JFFC only" and the JFFC adapter).
Policies are pure: no I/O, no clocks, randomness only from a passed Generator.
"""
