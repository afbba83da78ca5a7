"""The reliability suite: faults, bad input, load and security, each scenario a function returning figures.

::

    kvrouter reliability [--quick] [--json OUT]
        └─ suite.SCENARIOS: name ──▶ (area, run(quick) -> ScenarioResult)
              fault scenarios      in-process SimFleet + gateways on 127.0.0.1 (stack.Resources)
              load, flood          separate processes (procs): the gateway's RSS, fds and tasks sampled
              fuzz                 the event decoder + index (payloads) and the HTTP APIs (hypothesis)
        └─ figures.render_table ──▶ the table in docs/reliability.md

The tests (``tests/test_reliability_*.py``) call the same scenario functions with smaller settings.
"""
