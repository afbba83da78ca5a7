"""The lab: the simulated vLLM fleet, trace-driven evaluation, workloads, benchmarks, the reliability suite,
reports, the demo and the agreement check.

It imports the router; the router never imports it (``tests/test_architecture.py``).  Its commands reach
the ``kvrouter`` CLI through the ``kvrouter.commands`` entry point.
"""
