"""Reliability probes: measurements of how the running services behave under hostile or failing
conditions (a maximal prompt, fuzzed input, long soaks, killed or hung processes). Each probe
talks to a running gateway through the public API only and returns plain figures; the CLI and
the tests call the same functions."""

FAULT_SCENARIOS = ("hung-draft", "hung-target", "kill-target", "max-prompt")  # tools.reliability.faults
