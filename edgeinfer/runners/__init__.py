"""Runners: execute one StepPlan and return a StepResult (native models + backend ops, or llama.cpp)."""
